"""Built-in rules, each a plugin module with a ``kvcompose_rules`` hook.

What a rule's ``build(children, params)`` returns, per kind:

``load``
    an object with ``select(ask, n) -> Selection`` (:mod:`kvcompose.rules.load`)
``store``
    a tuple of child indices that receive the save hooks (:mod:`kvcompose.rules.store`)
``metadata``
    an object with ``pack(metas)`` / ``unpack(payload)`` (:mod:`kvcompose.rules.metadata`)
``params``
    an object with ``merge(results) -> dict | None`` (:mod:`kvcompose.rules.params`)
``completion``
    a zero-argument factory of trackers (:mod:`kvcompose.rules.completion`)
``faults``
    a frozenset of child indices whose errors are contained (:mod:`kvcompose.rules.faults`)
"""
