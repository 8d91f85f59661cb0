"""Plain nn.Modules: the models know nothing of devices or parallelism."""
