"""Token files (``data=tokens``): flat arrays of token ids cut into windows, every window read
once per epoch. Optional: the core never imports this folder by name."""
