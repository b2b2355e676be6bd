"""Every rule: the contract (:mod:`kvcompose.rules.contract`, one typed Protocol per rule kind)
and the built-in rules, each kind a plugin module with a ``kvcompose_rules`` hook.

=============  ===================================  ========================================
module         built-in rules                       Protocol their ``build`` returns
=============  ===================================  ========================================
``load``       ``first-wins``, ``longest-hit``,     :class:`~.contract.LoadRule`
               ``ranges``
``store``      ``all``, ``only``                    :class:`~.contract.StoreRule`
``metadata``   ``merge``                            :class:`~.contract.MetadataRule`
``params``     ``owners``, ``strict``               :class:`~.contract.ParamsRule`
``completion`` ``owner``                            :class:`~.contract.CompletionRule`
``faults``     ``fail``, ``isolate``, ``breaker``   :class:`~.contract.FaultsRule`
``checks``     cross-child checks (``kvcompose_check``), a rule's own (:class:`~.checks.ChecksPlan`)
=============  ===================================  ========================================

``children`` holds the child-index helpers for rules that name children. Plugins import all of
this through :mod:`kvcompose.api`. How the composite applies a load rule's decisions between
vLLM's calls is the adapter's (:mod:`kvcompose.vllm.loads`).
"""
