"""Shell sandboxes: a base tree seen through overlayfs layers, commands run confined by a zygote process.

- ``sandbox``: ``ShellSandbox`` and its factory (one-shot ``bash -c`` per call, or ``persistent=True``).
- ``persistent``, ``pty_shell``, ``shell_state``, ``criu``, ``criu_route``: the persistent shell and the routes
  that snapshot its processes (bash's own state, or a CRIU dump).
- ``layers``, ``layer_archive``: overlay layers, and their tar form for publishing.
- ``zygote``, ``zygote_process``, ``linux``, ``process``: confinement (namespaces, mounts, capabilities) and the
  command plumbing other backends share.

This package imports nothing itself: the folder backend builds on ``process`` and ``layers`` while the shell
sandbox builds on the folder backend, so re-exporting here would make an import cycle. Import the sandbox from
``tvcache.sandboxes`` (``from tvcache.sandboxes import ShellSandbox``).
"""
