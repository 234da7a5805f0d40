"""training/metrics.py: the progress line and TensorBoard's tags as Megatron-LM writes them.

    python -m pytest tests/training/test_metrics.py -q
"""

from megatron_chunkflow.training.metrics import LogConfig, StepLog

RECORD = {"step": 1, "loss": 2.5, "loss_tokens": 100, "tokens": 128, "tokens_per_s": 1000.0,
          "model_tflops": 0.5, "peak_mem_bytes": 2**30, "num_chunks": 3, "lr": 1e-4,
          "grad_norm": 0.75, "step_s": 0.128}


def test_tensorboard_tags_are_megatron_lms(tmp_path, capsys):
    """A Megatron-LM run's curves and ours share their tags where the records mean the same;
    ChunkFlow's own records sit under chunkflow/."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = StepLog(LogConfig(tensorboard_dir=str(tmp_path)), total_steps=1)
    log(RECORD)
    log.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"lm loss", "learning-rate", "grad-norm", "iteration-time", "throughput",
            "mem-max-allocated-bytes"} <= tags
    assert {"chunkflow/tokens_per_s", "chunkflow/num_chunks", "chunkflow/tokens"} <= tags
    assert not any(t.startswith("train/") for t in tags)
    assert events.Scalars("lm loss")[0].value == 2.5
    assert "loss 2.5000" in capsys.readouterr().err


def test_the_progress_line_names_what_a_step_runs(capsys):
    StepLog(LogConfig(), total_steps=2, unit="micro-batch")({**RECORD, "num_chunks": 1})
    StepLog(LogConfig(), total_steps=2, unit="micro-batch")({**RECORD, "num_chunks": 2})
    StepLog(LogConfig(), total_steps=2)(RECORD)
    err = capsys.readouterr().err
    assert "| 1 micro-batch |" in err and "| 2 micro-batches |" in err and "| 3 chunks |" in err
