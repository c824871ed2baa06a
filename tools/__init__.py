"""Commands around a run: prepare the demo model, merge or export an adapter, plot curves, regenerate configs.yaml."""
