"""Table tests of `decide()`'s rules (`bij.control.rules`), one file per rule, as Kubernetes' Job controller keeps
its rules and their tests; their builders are in `builders`. (A package, so its test modules are `rules.test_*`
beside tests/control's own.)"""
