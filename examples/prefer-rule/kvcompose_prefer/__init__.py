"""kvcompose plugin (an example of a third-party rule package): the ``prefer`` load rule.

``plugin`` holds everything kvcompose sees: the rule's parameters, the rule object (a
:class:`kvcompose.api.FirstWins` with its own order) and the ``kvcompose_rules`` hook. It imports
from kvcompose only :mod:`kvcompose.api`, and no vLLM.
"""

__version__ = "0.1.0"
