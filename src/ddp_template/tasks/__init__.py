"""The shipped tasks (``conf/task/``): classification (the default), regression and
segmentation. Each is one file a forker copies to write their own (``ddp_template.task``)."""
