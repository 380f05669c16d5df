"""The shipped tasks (``conf/task/``): classification (the default), regression, segmentation,
lm and contrastive (a batch-level loss). Each is one file a forker copies to write their own
(``ddp_template.task``)."""
