"""The tool repository and everything a tool comes from or runs through.

Scripts become schemas (``schema``, ``argparse_ast``; ``reflection`` only where allowed), schemas become an
immutable ``registry``; ``skills`` writes new skills into a repository; ``executor`` runs a script. MCP servers are
registry sources too: ``upstreams`` (the config file and tool names, standard library only) and ``upstream_hub``
(the client connections, needs the ``mcp`` extra). ``gateway`` serves the current registry from both, reloads it
and runs tools. Nothing here knows about models, channels or front ends.
"""
