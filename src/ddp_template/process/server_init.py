"""Imported first by every fork server this template starts (``preload.loaded_modules``), and
by nothing else: how the server itself runs.

- Without Python's cyclic garbage collector, as Python's ``gc.freeze`` documentation advises
  for a process that forks: the server only imports and forks, and the millions of objects
  torch's import allocates would otherwise be traced by pass after pass. They are frozen before
  each fork, so a fork's own passes (it gets the collector back at once) skip them too, and
  leave their memory pages shared.
- Ending without Python's teardown. When its parent exits the server raises ``SystemExit``,
  and tearing down torch and ``torch._dynamo`` takes about a second, which a shell pipe, a
  batch system or a test's leak check waits for (see :mod:`ddp_template.process.quick_exit`).
  Registered before anything else it imports, this handler runs after every other one. The
  forks never run it: each ends with ``os._exit`` after its target, as multiprocessing's
  children do.
"""

from __future__ import annotations

import atexit
import gc
import os

from ddp_template.process.quick_exit import exit_now

gc.disable()
os.register_at_fork(before=gc.freeze, after_in_child=gc.enable)
atexit.register(exit_now, 0)
