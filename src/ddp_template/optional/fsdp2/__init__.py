"""``parallel=fsdp2``: torch's FSDP2 (``fully_shard``) as a layout of the model over the ranks,
each rank holding a slice of every parameter, of its gradient and of its optimizer state."""
