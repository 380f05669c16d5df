"""The optional wing: features a forker may delete, folder and all, with their YAMLs and tests.

Each folder depends on the core and never the other way: the core reaches one only through a
registry entry or a YAML's ``_target_`` (a string), so deleting it leaves the default job and
the rest of the suite running. ``scripts/without.py`` proves that, one folder at a time.
"""
