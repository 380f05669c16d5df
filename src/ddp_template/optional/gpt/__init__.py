"""model=gpt and its sampler; optional: the core never imports this folder by name."""
