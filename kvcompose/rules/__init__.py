"""The built-in rules, each kind a plugin module with a ``kvcompose_rules`` hook, on the rule
contract (:mod:`kvcompose.contract`, one typed Protocol per rule kind, below the catalog).

=============  ===================================  ========================================
module         built-in rules                       Protocol their ``build`` returns
=============  ===================================  ========================================
``load``       ``first-wins``, ``longest-hit``,     :class:`~kvcompose.contract.LoadRule`
               ``ranges``
``store``      ``all``, ``only``                    :class:`~kvcompose.contract.StoreRule`
``metadata``   ``merge``                            :class:`~kvcompose.contract.MetadataRule`
``params``     ``owners``, ``strict``               :class:`~kvcompose.contract.ParamsRule`
``completion`` ``owner``                            :class:`~kvcompose.contract.CompletionRule`
``faults``     ``fail``, ``isolate``, ``breaker``   :class:`~kvcompose.contract.FaultsRule`
``checks``     cross-child checks (``kvcompose_check``), a rule's own (:class:`~.checks.ChecksPlan`)
=============  ===================================  ========================================

``children`` holds the child-index helpers for rules that name children. Plugins import all of
this through :mod:`kvcompose.api`. How the composite applies a load rule's decisions between
vLLM's calls is the adapter's (:mod:`kvcompose.vllm.loads`).
"""
