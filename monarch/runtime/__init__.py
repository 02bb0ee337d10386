"""The runtime: processes, the control plane, actors and supervision (see ARCHITECTURE §2, §3).

Worker-side modules (commands, codec, worker, bootstrap, hosting) never import `monarch.graph`.
"""
