"""The run's header lines: ``observe.run_log.log_run_header``."""
from observe.run_log import log_run_header  # noqa: F401
