"""What each problem registers for its config class (its task, its data set), found again for a
run's config by the config's class or the nearest base class that has one."""
from __future__ import annotations

from settings.errors import ConfigError


class ByConfigClass:
    def __init__(self, what: str, how: str):
        self.what, self.how = what, how  # for the error: "a task", "tasks.register"
        self.classes: dict[type, type] = {}

    def register(self, config_class: type, made_from_config: type):
        self.classes[config_class] = made_from_config

    def make(self, cfg):
        """The registered class made from ``cfg``."""
        for klass in type(cfg).__mro__:
            if klass in self.classes:
                return self.classes[klass](cfg)
        raise ConfigError(f"model={cfg.model}: no {self.what} is registered for "
                          f"{type(cfg).__name__}: register one with {self.how}")
