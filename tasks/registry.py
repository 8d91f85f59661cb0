"""The task of a run, found by the class of its config: ``register(config_class, task_class)``
(each problem's module does it for itself), ``make_task(cfg)``."""
from __future__ import annotations

from settings.errors import ConfigError

_TASKS = {}


def register(config_class: type, task_class: type):
    _TASKS[config_class] = task_class


def make_task(cfg):
    for klass in type(cfg).__mro__:
        if klass in _TASKS:
            return _TASKS[klass](cfg)
    raise ConfigError(f"model={cfg.model}: no task is registered for {type(cfg).__name__}: "
                      f"register one with tasks.register")
