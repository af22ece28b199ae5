"""The trainer's own metric sinks, found like any other by their `titan.metric_sinks` entry
points (`tensorboard`, `wandb`): `titan_core.MetricSinkFactory` is the contract, and a third
sink is a package that registers one there and is named in `[metrics] sinks`. Nothing is
imported here: each sink's module loads when its entry point is, and brings its library."""
