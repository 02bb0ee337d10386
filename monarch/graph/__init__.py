"""The compiler: trace ops into a torch.fx graph, propagate shardings, partition into rank programs.

Stages, each a function from one frozen artifact to the next: trace.py (TracedGraph), propagate.py and
the rule table (rules/, redistribute.py), partition.py (monarch.program's RankPrograms). Never imports
monarch.runtime.
"""
