"""The nixl plugin's test kit, beside kvcompose's generic one (:mod:`kvcompose.testing`).

- :mod:`~kvcompose_nixl.testing.fake_nixl`: a fake NIXL agent moving real bytes on CPU (the
  ``fake_nixl`` fixture, :mod:`~kvcompose_nixl.testing.pytest_plugin`);
- :mod:`~kvcompose_nixl.testing.host_buffer`: vLLM's NIXL host-buffer path on the CPU platform;
- :mod:`~kvcompose_nixl.testing.prefill_process`: a prefill instance in a process of its own;
- :mod:`~kvcompose_nixl.testing.side_channel`: a side channel that answers late or never.
"""
