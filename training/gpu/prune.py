"""Prune the degenerate heads of a finished run's EMA weights (Cordonnier et al. 2020, section 4.1) for a fine-tune.

    python3 training/gpu/prune.py RUN/last.pth.tar OUT.safetensors   # prints the heads per layer as JSON

The file starts a run of ``--model-kwargs '{"num_heads": <printed>}' --init-from OUT.safetensors``. Unlike
``python -m timm_attnconv.prune`` it counts no MACs, so it needs no fvcore, which the GPU machine lacks.
"""
import json
import sys

from safetensors.torch import save_file

from timm_attnconv.analysis import prune_degenerate_heads
from timm_attnconv.runs import load_training_checkpoint

checkpoint, out = sys.argv[1:]
model = load_training_checkpoint(checkpoint, use_ema=True)
heads = prune_degenerate_heads(model)
save_file({k: v.contiguous() for k, v in model.state_dict().items()}, out)
print(json.dumps(list(heads)))
