"""``fault_tolerance=live`` (experimental): ranks that die and rejoin without a restart.

Optional: the core names it by string (``tolerance.TOLERANCE``, ``tolerance.SUPERVISOR``) and
imports it only when chosen. ``supervisor`` is the launcher's side (the store, heartbeats,
memberships, replacements), ``membership`` a rank's (regroup), ``handover`` the state the
regrouped ranks continue from, ``keys`` the store's names shared by both sides.
"""
