"""Dense retrieval behind the search tool (`retriever: dense`): passages embedded by a local
Qwen2/Qwen3/Llama folder run with this project's JAX model code (mean of the final hidden
states over a passage's tokens, L2-normalised), ranked by cosine similarity to the query's.

The embeddings are computed once, in batches streamed from the corpus, into a float32 .npy
under `cache_dir/dense_<corpus sha256>_<encoder folder name>` and memory-mapped after that;
passages are read from the corpus by byte offset, as for BM25 (tools/search.py).

    tool = SearchTool("corpus.jsonl", retriever="dense", encoder_path="/models/my-encoder")

A decoder's mean-pooled states are a usable retriever only after embedding training
(e.g. Qwen3-Embedding, gte-Qwen2); a base LM's are weak. Search-R1's dense setting is e5.
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_tools import models
from jaxrl_tools.prompts import load_tokenizer
from jaxrl_tools.shapes import next_pow2
from jaxrl_tools.tools.search import PassageStore, corpus_hash, iter_passages


@functools.partial(jax.jit, static_argnums=0)
def _pooled(config, params, ids_BT, mask_BT):
    """Mean of the final hidden states over real tokens, L2-normalised: e_BD, float32."""
    h_BTD = models.transformer.hidden_states(config, params, ids_BT, attention_mask=mask_BT)
    m_BT1 = mask_BT[..., None].astype(jnp.float32)
    mean_BD = (h_BTD.astype(jnp.float32) * m_BT1).sum(1) / jnp.maximum(m_BT1.sum(1), 1.0)
    return mean_BD / jnp.maximum(jnp.linalg.norm(mean_BD, axis=-1, keepdims=True), 1e-12)


class DenseIndex:
    """Cosine retrieval over mean-pooled hidden states of a local encoder folder.

    Args:
      corpus_path: jsonl corpus (the search tool's format).
      encoder_path: a Hugging Face Qwen2/Qwen3/Llama folder with its tokenizer.
      cache_dir: where embeddings are kept (default ~/.cache/jaxrl_tools/dense).
      batch_size: passages per forward pass.
      max_len: tokens kept per passage.
    """

    def __init__(
        self,
        corpus_path: str | Path,
        encoder_path: str | Path,
        cache_dir: str | Path | None = None,
        batch_size: int = 32,
        max_len: int = 256,
    ):
        self.corpus_path, self.batch_size, self.max_len = Path(corpus_path), batch_size, max_len
        self.tokenizer = load_tokenizer(encoder_path)
        self.config, self.params = models.from_pretrained(encoder_path)
        cache_dir = Path(cache_dir or Path.home() / ".cache" / "jaxrl_tools" / "dense")
        name = f"dense_{corpus_hash(self.corpus_path)[:24]}_{Path(encoder_path).name}"
        self.index_dir = cache_dir / name
        self.loaded_from_cache = (self.index_dir / "embeddings.npy").exists()
        if not self.loaded_from_cache:
            cache_dir.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(dir=cache_dir, prefix=".tmp_"))
            try:
                self._build(tmp)
                os.replace(tmp, self.index_dir)
            except OSError:
                shutil.rmtree(tmp, ignore_errors=True)  # another process built it first
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        self.embeddings = np.load(self.index_dir / "embeddings.npy", mmap_mode="r")
        offsets = np.load(self.index_dir / "offsets.npy", mmap_mode="r")
        self.passages = PassageStore(self.corpus_path, offsets)

    def __len__(self) -> int:
        return len(self.passages)

    def embed(self, texts: list[str]) -> np.ndarray:
        """L2-normalised mean-pooled embeddings [len(texts), hidden], float32. Batches are
        padded to `batch_size` rows and a power-of-two length, so few shapes compile."""
        out = []
        for i in range(0, len(texts), self.batch_size):
            chunk = texts[i : i + self.batch_size]
            enc = [self.tokenizer(t)["input_ids"][: self.max_len] or [0] for t in chunk]
            width = next_pow2(max(len(e) for e in enc), 64)
            ids = np.zeros((self.batch_size, width), np.int32)
            mask = np.zeros((self.batch_size, width), np.int32)
            for r, e in enumerate(enc):  # left-padded, as the engine's prompts
                ids[r, width - len(e) :], mask[r, width - len(e) :] = e, 1
            mask[len(enc) :, -1] = 1  # filler rows: one token, so no row is all padding
            out.append(np.asarray(_pooled(self.config, self.params, ids, mask))[: len(enc)])
        return np.concatenate(out) if out else np.zeros((0, self.config.hidden_size), np.float32)

    def _build(self, out: Path) -> None:
        offsets, texts = [], []
        for offset, _ in iter_passages(self.corpus_path):
            offsets.append(offset)
        if not offsets:
            raise ValueError(f"{self.corpus_path}: empty corpus")
        np.save(out / "offsets.npy", np.array(offsets, np.int64))
        store = PassageStore(self.corpus_path, np.array(offsets, np.int64))
        emb = np.lib.format.open_memmap(
            out / "embeddings.npy", "w+", np.float32, (len(offsets), self.config.hidden_size)
        )
        step = self.batch_size * 64
        for start in range(0, len(offsets), step):
            texts = [
                f"{p.title} {p.text}"
                for p in map(store.__getitem__, range(start, min(start + step, len(offsets))))
            ]
            emb[start : start + len(texts)] = self.embed(texts)
        emb.flush()
        del emb

    def search(self, query: str, k: int = 3) -> list[tuple[int, float]]:
        """Top-k (passage index, cosine), best first."""
        q_D = self.embed([query])[0]
        scores_N = np.asarray(self.embeddings @ q_D)
        k = min(k, len(scores_N))
        top = np.argpartition(-scores_N, k - 1)[:k]
        top = top[np.argsort(-scores_N[top], kind="stable")]
        return [(int(i), float(scores_N[i])) for i in top]
