"""What the test files share besides fixtures (those stay in conftest.py): `from support import ...` in a test
file, a fixture, or a script a test starts with tests/ on its path. A module per job; this file names them all."""
from .heads import (
    OLD_DECODER_NAMES,
    adamw_steps,
    collated_with_a_pad_sample,
    exported_after_a_step,
    old_parameter_name,
    text_methods,
    tiny_head,
)
from .interrupts import ctrl_c_when, signal_in_mask
from .mlflow_server import (
    MLFLOW_JOB_STORE,
    mlflow_job_stores,
    running_mlflow_server,
    stop_server,
)
from .paths import ROOT, SAMPLES, TESTS, TINY_CONFIGS
from .runs import (
    assert_resumed_run_repeats,
    free_port,
    json_lines,
    pretrain_env,
    pretrain_stopped_and_resumed,
    result_line,
)
from .samples import beir_subset, prepare_sample, save_tiny_bert, write_beir
from .walk_through import walk_through_blocks

__all__ = ["MLFLOW_JOB_STORE", "OLD_DECODER_NAMES", "ROOT", "SAMPLES", "TESTS", "TINY_CONFIGS", "adamw_steps",
           "assert_resumed_run_repeats", "beir_subset", "collated_with_a_pad_sample", "ctrl_c_when",
           "exported_after_a_step", "free_port", "json_lines", "mlflow_job_stores", "old_parameter_name",
           "prepare_sample", "pretrain_env", "pretrain_stopped_and_resumed", "result_line", "running_mlflow_server",
           "save_tiny_bert", "signal_in_mask", "stop_server", "text_methods", "tiny_head", "walk_through_blocks",
           "write_beir"]
