"""One boundary to torch's internals.

Every private torch name the harness reads or replaces is reached through this package, and
nowhere else (tests/project/test_torch_boundary.py): ``rdzv`` (the dynamic rendezvous),
``agent`` (torchelastic's agent, process context, timer server, event handlers), ``dcp``
(DCP's fsspec classes), ``nn`` (meshes, modules, optimizers, tensors) and ``modules`` (private
modules imported by name). Each name is looked up once and grouped into a feature that
``probe`` checks at start-up; where a torch lacks one, the feature falls back to torch's own
behaviour and says so once. ``release`` holds the supported range and ``host`` the check
that ``run``, ``submit`` and ``agent`` make before launching anything.

Importing this package imports no torch (``release``, ``host``, ``probe`` and ``modules``
import it only when asked); the other modules do. docs/torch-versions.md lists every name.
"""
