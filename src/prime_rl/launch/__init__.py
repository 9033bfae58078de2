"""The launcher: from a validated config to running processes.

``resolve`` decides every derived setting once; ``deployment`` places processes on GPUs and nodes
and renders their specs; ``launcher`` runs them (tmux or headless) and stops them all together;
``ports`` checks what they will bind; ``warm`` attaches runs to servers that outlive them;
``slurm`` renders and runs the batch job; ``resume`` picks and rewinds a step; ``teacher`` places
the distillation teacher; ``memory`` estimates what a run needs before anything starts.
"""
