"""The task of a run, found by the class of its config: ``register(config_class, task_class)``
(each problem's module does it for itself), ``make_task(cfg)``."""
from settings.registry import ByConfigClass

_TASKS = ByConfigClass("task", "tasks.register")
register = _TASKS.register
make_task = _TASKS.make
