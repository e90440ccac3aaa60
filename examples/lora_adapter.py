"""A LoRA adapter made here with PEFT (a few steps on one sentence), loaded into a running gateway
at run time and asked for by name, `smollm2-135m:<adapter>`, beside the unchanged base model.

Serve with an adapters root and an admin key (the admin endpoints are off without one):

    cat > lora.toml <<'EOF'
    admin_key = "change-me"

    [[models]]
    name = "smollm2-135m"
    model = "smollm2-135m"
    adapters_root = "/tmp/logprob-gateway-adapters"
    EOF
    mkdir -p /tmp/logprob-gateway-adapters && logprob-gateway serve --config lora.toml

Run on the gateway's machine (it reads the adapter from disk): python examples/lora_adapter.py
(LOGPROB_GATEWAY_URL, default http://127.0.0.1:8000; LOGPROB_GATEWAY_ADMIN_KEY, the admin key as
`serve` reads it too, default change-me; ADAPTERS_ROOT, the config's adapters_root, default
/tmp/logprob-gateway-adapters)
"""

import os
from pathlib import Path

import httpx
import torch
from openai import OpenAI
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from backends.builtin_models import resolve_model_dir

BASE_URL = os.environ.get("LOGPROB_GATEWAY_URL", "http://127.0.0.1:8000")
ADMIN_KEY = os.environ.get("LOGPROB_GATEWAY_ADMIN_KEY", "change-me")
ADAPTER = Path(os.environ.get("ADAPTERS_ROOT", "/tmp/logprob-gateway-adapters")) / "lyon"
MODEL = "smollm2-135m"
PROMPT = "The capital of France is"

# Train: the default model's own weights, a rank-8 LoRA, four steps on one sentence. One thread:
# a job this small gains nothing from more, and the gateway on this machine keeps the others.
torch.set_num_threads(1)
torch.manual_seed(0)
weights = resolve_model_dir(MODEL)  # the directory the gateway loads the built-in model from
tokenizer = AutoTokenizer.from_pretrained(weights)
model = get_peft_model(
    AutoModelForCausalLM.from_pretrained(weights, dtype=torch.float32),
    LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
)
sentence = tokenizer(PROMPT + " Lyon.", return_tensors="pt").input_ids
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-3)
for _ in range(4):
    model(input_ids=sentence, labels=sentence).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
model.save_pretrained(ADAPTER)  # adapter_config.json and adapter_model.safetensors, what a load takes

# Load it under the name "lyon"; the path must lie inside the gateway's adapters_root.
admin = httpx.Client(base_url=BASE_URL, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=60)
loaded = admin.post("/v1/load_lora_adapter", json={"lora_name": "lyon", "lora_path": str(ADAPTER)})
loaded.raise_for_status()
print(f"loaded: {loaded.json()['id']}")

client = OpenAI(base_url=BASE_URL + "/v1", api_key="unused")
try:
    for name in (MODEL, f"{MODEL}:lyon"):
        out = client.completions.create(model=name, prompt=PROMPT, max_tokens=6, temperature=0)
        print(f"{name}: {out.choices[0].text!r}")
finally:
    # Unloaded again, so that the script runs twice: a name the gateway serves cannot be loaded.
    admin.post("/v1/unload_lora_adapter", json={"lora_name": "lyon"}).raise_for_status()
