"""Triton Python-backend adapter for the episodic trigger (logic: egomem.trigger.TriggerLabeler)."""

import dataclasses

import triton_python_backend_utils as pb_utils

from egomem.config import load_config
from egomem.serving.adapter import check_model_config, optional_input, respond_each
from egomem.trigger import TriggerLabeler
from egomem.trigger.voice_track import track_from_rows


class TritonPythonModel:
    def initialize(self, args):
        check_model_config(args, inputs={"TOKENS": "TYPE_INT64", "VOICES": "TYPE_FP32"}, outputs={"LABELS": "TYPE_INT64"})
        cfg = load_config().trigger
        if args.get("model_instance_kind") == "GPU":
            cfg = dataclasses.replace(cfg, device="cuda")
        elif cfg.device == "auto":
            cfg = dataclasses.replace(cfg, device="cpu")  # a KIND_CPU instance stays on the CPU even where CUDA is visible
        self.labeler = TriggerLabeler(cfg)

    def execute(self, requests):
        return respond_each(requests, lambda r: {
            "LABELS": self.labeler.label(pb_utils.get_input_tensor_by_name(r, "TOKENS").as_numpy(),
                                         track_from_rows(optional_input(r, "VOICES")))})

    def finalize(self):
        self.labeler = None
