"""The rules `reconcile.decide()` dispatches to, one module each (as Kubernetes' Job controller keeps
its rules): `ended` (a bij that is over), `permissions` (the worker identity's grants before the first
pod), `stop` (cancel and deadline), `steps` (the step Jobs' life cycle), `rounds` (a round's Job, then
the next round or publishing), `canary` (spec.canary before round 0), `publish` (the publish passes and
the manifest) and `pool_round` (a round over spec.workers.pools).

Each is a pure function of the spec and what `observe` read, returning a `decisions.Decision`.
"""
