"""
bench: side-by-side timings and memory, a module per question. Run from the repository:

    python -m bench scan          # h = scan(a, b): every backend vs the loop and a memory floor      (scan.py)
    python -m bench depth         # work and depth of each scan, counted, beside its CPU time          (scan.py)
    python -m bench crossover     # forward only: from which width the loop beats pscan on a CPU      (scan.py)
    python -m bench selective     # selective_scan: eager backends vs the fused path          (scan.py)
    python -m bench mamba2_ssd    # Mamba-2's SSD and block vs Mamba-1's scan and block                (scan.py)
    python -m bench train         # one training step: the default Mamba, its alternatives, the GPT   (train.py)
    python -m bench profile       # where the default Mamba's training step goes, op by op            (train.py)
    python -m bench mamba2_train  # one training step of Mamba-2 candidates, Mamba-1 and the GPT      (train.py)
    python -m bench mamba2_profile  # where that step's time goes: matmuls vs the rest                (train.py)
    python -m bench mamba3        # Mamba-3 candidates vs Mamba-1, Mamba-2 and the GPT; generation    (train.py)
    python -m bench race --max-time 300 --runs 2  # GPT vs default Mamba, whole trainings at equal time (race.py)
    python -m bench sweep --max-time 300 [--round 2|3|4]  # the grid that chose the CPU defaults      (race.py)
    python -m bench generate      # cost per generated token at position 16 vs 4096                   (decode.py)
    python -m bench decode        # prefill and decode tokens/s at the official shapes, beside transformers (decode.py)
    python -m bench load          # peak memory of a bf16 load of mamba-1.4b's shape                  (load.py)
    python -m bench roofline      # a MODEL of one training step on four GPUs (no GPU needed)         (roofline.py)
    python -m bench graphs        # what torch.compile makes of each model: graphs, breaks, recompiles (graphs.py)
    python -m bench all           # every table above but race, sweep and load, each in its own process
    python -m bench gpu --data data/tinyshakespeare.txt  # a CUDA machine, offline, within --budget s  (gpu.py)
    python -m bench gpu --tiny    # the same parts in the same order, at a toy size on the CPU

Every table is measured in one process with the candidates interleaved (round-robin, median of
the repeats), so a noisy machine slows them all alike and the ratios stay meaningful. One thread
by default (--threads). Every Mamba-1 model runs mamba_engine as the trainer does (accelerate).
Peak memory is read from /proc/self/status (VmHWM after resetting it with /proc/self/clear_refs),
one subprocess per case, so it is Linux only. The command line is __main__.py; shared helpers are
common.py.
"""
