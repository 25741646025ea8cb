"""The cookbook's weights.download against the server: a training checkpoint is exported
(create_training_client_from_state + save_weights_external, age-encrypted), downloaded through
signed URLs and decrypted; an external weights checkpoint is downloaded as plain files. Both are
loaded with PEFT locally and must score a prompt as the server does.

Usage: TINKER_BASE_URL=... TINKER_API_KEY=tml-... python sdk_download.py MODEL BASE_MODEL_DIR OUT_DIR
"""
import json
import os
import sys

import numpy as np
import tinker
import torch
from peft import PeftModel
from tinker import types
from tinker_cookbook import weights
from transformers import AutoModelForCausalLM

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79]


def local_logprobs(base_dir: str, adapter_dir: str) -> list[float]:
    base = AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter_dir).eval()
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return [float(lp[i - 1, PROMPT[i]]) for i in range(1, len(PROMPT))]


def main() -> None:
    model, base_dir, out_dir = sys.argv[1], sys.argv[2], sys.argv[3]
    svc = tinker.ServiceClient()
    tc = svc.create_lora_training_client(base_model=model, rank=4, seed=21).result()
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(PROMPT[:-1]),
        loss_fn_inputs={"target_tokens": np.array(PROMPT[1:], dtype=np.int64), "weights": np.ones(len(PROMPT) - 1, dtype=np.float32)},
    )
    for _ in range(3):
        tc.forward_backward([datum], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    state = tc.save_state("final").result().path
    external = tc.save_weights_external("final-ext").result().path
    sampler = svc.create_sampling_client(model_path=tc.save_weights_for_sampler("final-s").result().path).result()
    served = sampler.compute_logprobs(types.ModelInput.from_ints(PROMPT)).result()[1:]

    out: dict[str, object] = {"served": served}
    for key, path in (("training", state), ("external", external)):
        target = os.path.join(out_dir, key)
        weights.download(tinker_path=path, output_dir=target)
        out[f"{key}_files"] = sorted(os.listdir(target))
        out[key] = local_logprobs(base_dir, target)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
