"""kvcompose plugin (an example of a third-party rule package): the ``prefer`` load rule.

``plugin`` holds everything kvcompose sees: the rule's parameters, the rule object (a
:class:`kvcompose.rules.contract.LoadRule`) and the ``kvcompose_rules`` hook. It imports no vLLM.
"""

__version__ = "0.1.0"
