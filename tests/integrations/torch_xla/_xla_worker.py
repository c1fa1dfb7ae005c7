"""Runs the torch_xla checks of the tests in a fresh process (``python -m tests.integrations.torch_xla._xla_worker``).

torch_xla must start with ``PJRT_DEVICE=CPU``, ``CPU_NUM_DEVICES=4`` and the
HLO dump directory in ``XLA_FLAGS``, none of which the pytest process (which
runs jax with 8 host devices) can give it. Prints one JSON line.
"""

import json
import os
import sys
import tempfile

# batch·seq (96) differs from every parameter dim: the cost model tells batch-dependent
# tensors from parameter-derived ones by shape.
SHAPE = {"vocab_size": 64, "max_seq_len": 12, "num_layers": 2, "num_heads": 4, "d_model": 32}
BATCH, SEQ, STEPS = 8, 12, 5


def main() -> None:
    if "torch_xla" in sys.modules:
        raise RuntimeError("run in a fresh process")
    with tempfile.TemporaryDirectory(prefix="orchestrator-test-") as tmp:
        dump = os.path.join(tmp, "hlo")
        os.environ.update(
            PJRT_DEVICE="CPU",
            CPU_NUM_DEVICES="4",
            ORCHESTRATOR_HLO_DUMP=dump,
            XLA_FLAGS=f"--xla_dump_to={dump} --xla_dump_hlo_as_text --xla_dump_hlo_module_re=SyncTensorsGraph.*",
        )
        from orchestrator.bench._torch import run
        from recipes.torch_gpt import GPTConfig

        records = run(
            batch=BATCH, seq=SEQ, steps=STEPS, config=GPTConfig(**SHAPE), checkpoint_dir=os.path.join(tmp, "ckpt")
        )
    print(json.dumps({"shape": SHAPE, "batch": BATCH, "seq": SEQ, "configs": records}))


if __name__ == "__main__":
    main()
