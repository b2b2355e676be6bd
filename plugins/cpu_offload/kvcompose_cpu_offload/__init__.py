"""kvcompose plugin for the ``cpu-offload`` connector type.

``plugin`` describes the type to kvcompose (options, vLLM config, checks) and imports no vLLM;
``connector`` is the class vLLM loads: vLLM's ``SimpleCPUOffloadConnector`` with a portable
worker (``portable_worker``) on platforms that have no CUDA copy engine.
"""

__version__ = "0.1.0"
