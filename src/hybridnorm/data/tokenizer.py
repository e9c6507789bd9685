"""Tokenizers behind one small protocol: a byte-level BPE trained locally with HF ``tokenizers``, or bytes.

Both save to a ``tokenizer.json`` that :func:`load_tokenizer` reads back (the BPE one is the standard HF
format, so ``transformers.PreTrainedTokenizerFast(tokenizer_file=...)`` reads it too). :func:`get_tokenizer`
trains a BPE once per corpus and vocabulary size and caches it under
``<cache_dir>/<corpus fingerprint>-bpe<vocab>/``, the folder that also holds the tokenized data.

The end-of-text token, which ends every training document and is the exported model's eos (where HF's
``generate`` stops), is the first of :data:`EOT_ALIASES` in the vocabulary. A tokenizer with none of them (DeepSeek's
``<｜end▁of▁sentence｜>``) takes the ``eos_token`` its folder names the Hugging Face way, in
``tokenizer_config.json`` (else ``special_tokens_map.json``) beside its ``tokenizer.json``; saved, such a
tokenizer writes that file too (:data:`EOS_FILE`), so the choice travels with it into run folders, checkpoints
and the data cache, and its fingerprint covers it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Protocol, runtime_checkable

from hybridnorm import leftovers, plain_data
from hybridnorm.data import byte_file
from hybridnorm.errors import ConfigError

if TYPE_CHECKING:
    from hybridnorm.data.corpus import Corpus

EOT = "<|endoftext|>"
EOT_ALIASES: tuple[str, ...] = (EOT, "<|end_of_text|>", "</s>", "<eos>")  # for user-supplied tokenizers
# the files of a Hugging Face folder that name its eos_token, read in this order (transformers reads both)
EOS_FILES: tuple[str, ...] = ("tokenizer_config.json", "special_tokens_map.json")
EOS_FILE = EOS_FILES[0]  # what a tokenizer whose end-of-text token was declared so writes beside tokenizer.json
KINDS: tuple[str, ...] = ("bpe", "bytes")
MIN_BPE_VOCAB = 257  # 256 byte symbols + <|endoftext|>: no merges at all
CACHE_FILE_MODE = 0o644  # mkstemp makes 0600 files; a shared cache must be readable by every user


@runtime_checkable
class Tokenizer(Protocol):
    kind: str
    vocab_size: int
    eot_id: int
    start_id: int  # the token every context starts from (prompts, scored texts): see BPETokenizer
    fingerprint: str  # a hash of the saved form: tokenized data records it to refuse a mismatched tokenizer
    files: tuple[str, ...]  # the names save() writes into a folder

    def encode(self, text: str) -> list[int]: ...
    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]: ...
    # skip_special_tokens: without the special tokens (our end-of-text; a folder's), as transformers decodes
    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str: ...
    def save(self, directory: str | Path) -> Path: ...
    def token_to_id(self, token: str) -> int | None: ...  # a vocabulary entry's id (None: no such token)
    def id_to_token(self, token_id: int) -> str | None: ...


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255 and ``<|endoftext|>`` is 256: no training, any text round-trips."""

    kind = "bytes"
    vocab_size: int = byte_file.FIELDS["vocab_size"]  # 257
    eot_id: int = byte_file.FIELDS["eot_id"]  # 256
    start_id: int = eot_id
    files = ("tokenizer.json",)

    def __init__(self) -> None:
        self.fingerprint = hashlib.sha256(self._json().encode()).hexdigest()

    def _json(self) -> str:
        return json.dumps(byte_file.FIELDS)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        # eot becomes the visible marker; a window cut inside a multi-byte character decodes to U+FFFD
        out, buf = [], bytearray()
        for i in ids:
            if i == self.eot_id:
                out.append(buf.decode("utf-8", errors="replace") + ("" if skip_special_tokens else EOT))
                buf.clear()
            else:
                buf.append(int(i))
        return "".join(out) + buf.decode("utf-8", errors="replace")

    def save(self, directory: str | Path) -> Path:
        return atomic_write(Path(directory) / "tokenizer.json", self._json())

    def token_to_id(self, token: str) -> int | None:  # a byte is no string: the one named token is eot
        return self.eot_id if token == EOT else None

    def id_to_token(self, token_id: int) -> str | None:
        return EOT if token_id == self.eot_id else None


class BPETokenizer:
    """A wrapped ``tokenizers.Tokenizer`` (``.hf``); special tokens inside text are not split.

    ``start_id``, the token a prompt or a scored text starts from: the one token the tokenizer's own
    post-processor puts before a text, if it puts one (a BOS: Llama's, Mistral's ``<s>``; what transformers
    and lm-eval's HF backend add), else the end-of-text token, our document separator (ours, GPT-2's, Qwen's:
    a model trained on documents joined by it has learned that a document starts after it)."""

    kind = "bpe"

    def __init__(self, hf: object, source: str = "<memory>", eos_token: str | None = None) -> None:
        """``eos_token``: the end-of-text token a tokenizer with none of :data:`EOT_ALIASES` declares (its
        folder's ``eos_token``); ignored when it has one of them (see :func:`load_tokenizer`)."""
        self.hf = hf
        self.source = source  # named when it cannot encode a text
        self.vocab_size: int = hf.get_vocab_size(with_added_tokens=True)
        eot_id = alias_eot_id(hf)
        self.declared_eos: str | None = None  # set when the end-of-text token is the declared one
        if eot_id is None:
            if eos_token is None:
                raise ConfigError(f"tokenizer {source} has no end-of-text token (one of {', '.join(EOT_ALIASES)}"
                                  f"), and no {' or '.join(EOS_FILES)} beside it names one (eos_token)")
            eot_id = hf.token_to_id(eos_token)
            if eot_id is None:
                raise ConfigError(f"tokenizer {source}: its declared eos_token {eos_token!r} is not one of its "
                                  "tokens")
            self.declared_eos = eos_token
        self.eot_id: int = eot_id
        self.start_id: int = _start_id(hf, self.eot_id, source)
        # the declared token is part of what the tokenizer is (its documents' separator): two tokenizer.json
        # files alike with different eos_tokens are two tokenizers; with an alias the hash is the file's alone
        self.fingerprint = hashlib.sha256(hf.to_str().encode()
                                          + (self._eos_json().encode() if self.declared_eos else b"")).hexdigest()

    @property
    def files(self) -> tuple[str, ...]:
        return ("tokenizer.json",) + ((EOS_FILE,) if self.declared_eos else ())

    def _eos_json(self) -> str:
        return json.dumps({"eos_token": self.declared_eos}, ensure_ascii=False, indent=1)

    def encode(self, text: str) -> list[int]:
        with self._encoding():
            return self.hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        # the _fast variant skips offsets; both run on all cores (RAYON_NUM_THREADS caps them)
        with self._encoding():
            return [e.ids for e in self.hf.encode_batch_fast(list(texts), add_special_tokens=False)]

    @contextlib.contextmanager
    def _encoding(self) -> Iterator[None]:
        """A text the tokenizer cannot encode (a WordLevel model without an unknown token meeting a word it
        lacks) raises the Rust side's bare ``Exception``: a ConfigError naming the tokenizer file instead."""
        try:
            yield
        except Exception as e:  # tokenizers raises Exception itself, no subclass
            if type(e) is not Exception:
                raise
            raise ConfigError(f"tokenizer {self.source} cannot encode this text: {e}") from None

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def save(self, directory: str | Path) -> Path:
        if self.declared_eos:  # first: a tokenizer.json beside it is only ever read with it
            atomic_write(Path(directory) / EOS_FILE, self._eos_json())
        return atomic_write(Path(directory) / "tokenizer.json", self.hf.to_str())

    def token_to_id(self, token: str) -> int | None:
        return self.hf.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.hf.id_to_token(token_id)


def with_start(tokenizer: Tokenizer, ids: list[int]) -> list[int]:
    """A prompt's or context's ids after the start token: prefixed with ``start_id``, unless the text itself
    began with that token (its string, which the tokenizer reads as the one token), as a chat template's
    rendering of Llama 3's ``<|begin_of_text|>`` does: transformers' ``apply_chat_template`` and lm-eval's
    HF backend (``has_bos_prefix``) then add no second one either."""
    return ids if ids[:1] == [tokenizer.start_id] else [tokenizer.start_id, *ids]


def stop_token_ids(tokens: Sequence[str], tokenizer: Tokenizer, where: str) -> tuple[int, ...]:
    """The ids of ``tokens`` (``data.stop_tokens``: where generation ends besides the end-of-text token), each
    a whole entry of ``tokenizer``'s vocabulary; one ConfigError naming ``where`` and the token otherwise."""
    ids = []
    for token in tokens:
        token_id = tokenizer.token_to_id(token)
        if token_id is None:
            raise ConfigError(f"{where}: data.stop_tokens names {token!r}, which is not a token of the run's "
                              f"{tokenizer.kind} tokenizer (a stop token is one vocabulary entry, such as "
                              f"{tokenizer.id_to_token(tokenizer.eot_id)!r})"[:400])
        ids.append(token_id)
    return tuple(dict.fromkeys(ids))


def alias_eot_id(hf: object) -> int | None:
    """The id of the first of :data:`EOT_ALIASES` in ``hf``'s vocabulary, else None."""
    return next((i for i in (hf.token_to_id(t) for t in EOT_ALIASES) if i is not None), None)


def declared_eos(folder: Path) -> str | None:
    """The ``eos_token`` that ``folder``'s first :data:`EOS_FILES` naming one declares (a string, or an
    ``AddedToken`` as ``{"content": ...}``), else None. A file that cannot be read, or whose eos_token is
    neither, is one ConfigError naming it."""
    for name in EOS_FILES:
        file = folder / name
        if not file.is_file():
            continue
        try:
            data = plain_data.loads(file.read_bytes())
        except OSError as e:
            raise ConfigError(f"cannot read {file}: {e.strerror or e}") from None
        except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, the depth limit
            raise ConfigError(f"cannot read {file}: {plain_data.describe_error(e)}") from None
        eos = data.get("eos_token") if isinstance(data, dict) else None
        if isinstance(eos, dict):
            eos = eos.get("content")
        if eos is None:  # not named here (or null: none): the next file may name it
            continue
        if not (isinstance(eos, str) and eos):
            raise ConfigError(f"{file}: eos_token must be a token (a string, or {{\"content\": <string>}}), "
                              f"got {data['eos_token']!r}"[:300])
        return eos
    return None


def _start_id(hf: object, eot_id: int, source: str) -> int:
    """The single token ``hf``'s post-processor adds before a text, else ``eot_id`` (none, or several)."""
    try:
        plain = hf.encode("a", add_special_tokens=False).ids
        full = hf.encode("a", add_special_tokens=True).ids
    except Exception:  # a post-processor the Rust side cannot apply to one text: nothing is added then
        return eot_id
    lead = next((i for i in range(len(full) - len(plain) + 1) if full[i:i + len(plain)] == plain), 0)
    if lead != 1:
        return eot_id
    if hf.id_to_token(full[0]) is None:  # the template names its own ids: one may be no token at all
        raise ConfigError(f"tokenizer {source}: its post-processor puts id {full[0]} before every text, which "
                          f"is no token of its vocabulary ({hf.get_vocab_size(with_added_tokens=True)} tokens)")
    return full[0]


def train_bpe(texts: Iterable[str], vocab_size: int = 8192) -> BPETokenizer:
    """Byte-level BPE (GPT-2 pre-tokenization) with ``<|endoftext|>`` as id 0; deterministic for fixed
    ``texts``. The vocabulary reaches ``vocab_size`` unless the text runs out of distinct pairs."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    check_vocab_size(vocab_size)
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    texts = texts if isinstance(texts, Sequence) else list(texts)
    hf.train_from_iterator(texts, trainer, length=len(texts))
    return BPETokenizer(hf)


def load_tokenizer(path: str | Path, vocab_size: int | None = None) -> Tokenizer:
    """Read a ``tokenizer.json`` (or the folder holding one); ``vocab_size`` given: it must match. Its
    end-of-text token: the first of :data:`EOT_ALIASES` it has, else the ``eos_token`` its folder declares
    (:func:`declared_eos`)."""
    path = Path(path)
    file = path / "tokenizer.json" if path.is_dir() else path
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read tokenizer file {file}: {e}") from None
    try:
        head = plain_data.loads(text)  # the depth limit, before the Rust parser sees the text
    except ValueError as e:
        raise ConfigError(f"cannot read tokenizer file {file}: {plain_data.describe_error(e)}") from None
    if byte_file.is_byte_file(head):
        byte_file.check(head, file)  # the marker decides the tokenizer: what else the file says must fit it
        tok: Tokenizer = ByteTokenizer()
    else:
        from tokenizers import Tokenizer as HFTokenizer

        try:
            hf = HFTokenizer.from_str(text)
        except Exception as e:  # the Rust side raises a bare Exception for a malformed file
            raise ConfigError(f"tokenizer file {file} is not a tokenizers JSON file: {e}") from None
        # the folder's declared eos_token only where the vocabulary has none of the aliases: then nothing that
        # loaded before reads another file or changes (Llama 3 Instruct declares <|eot_id|>, Qwen's chat models
        # <|im_end|>: the documents' separator stays <|end_of_text|> / <|endoftext|>)
        eos = declared_eos(file.parent) if alias_eot_id(hf) is None else None
        tok = BPETokenizer(hf, source=str(file), eos_token=eos)
    if vocab_size is not None and tok.vocab_size != vocab_size:
        raise ConfigError(f"tokenizer file {file} has vocab size {tok.vocab_size}, expected {vocab_size}")
    return tok


def get_tokenizer(corpus: Corpus, kind: str = "bpe", vocab_size: int = 8192,
                  cache_dir: str | Path | None = None) -> Tokenizer:
    """``kind``: "bpe" (trained on ``corpus.train``, cached by fingerprint), "bytes", or a path to a
    ``tokenizer.json``. A cache hit loads the saved file instead of retraining."""
    if kind == "bytes":
        return ByteTokenizer()
    if kind != "bpe":
        if isinstance(kind, (str, Path)) and Path(kind).exists():
            return load_tokenizer(kind)
        raise ConfigError(f"data.tokenizer={kind!r} is not one of {', '.join(map(repr, KINDS))} "
                          f"or an existing tokenizer.json path")
    check_vocab_size(vocab_size)
    folder = resolve_cache_dir(cache_dir) / f"{corpus.fingerprint[:16]}-bpe{vocab_size}"
    with file_lock(folder):  # DDP ranks preparing at once: one trains, the others load its result
        return load_or_train_bpe(folder, corpus.train, vocab_size)


def load_or_train_bpe(folder: Path, texts: Sequence[str], vocab_size: int) -> Tokenizer:
    """``folder/tokenizer.json`` if it is there (a cache hit), else a BPE trained on ``texts`` and saved
    there. The caller holds :func:`file_lock` on ``folder``."""
    if (folder / "tokenizer.json").is_file():
        try:
            return load_tokenizer(folder, vocab_size=None)
        except ConfigError:  # a damaged cache entry: retrain over it
            pass
    tok = train_bpe(texts, vocab_size)
    tok.save(folder)
    return tok


def check_vocab_size(vocab_size: int) -> None:
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < MIN_BPE_VOCAB:
        raise ConfigError(f"data.vocab_size={vocab_size!r} must be an integer >= {MIN_BPE_VOCAB} "
                          f"(256 bytes + {EOT})")


def resolve_cache_dir(cache_dir: str | Path | None = None) -> Path:
    """``cache_dir``, else ``$HYBRIDNORM_CACHE``, else ``~/.cache/hybridnorm``."""
    if cache_dir is None:
        cache_dir = os.environ.get("HYBRIDNORM_CACHE") or Path.home() / ".cache" / "hybridnorm"
    return Path(cache_dir).expanduser()


@contextlib.contextmanager
def file_lock(folder: Path) -> Iterator[None]:
    """An exclusive advisory lock on ``folder/.lock`` (creating the folder); a no-op without fcntl. A cache that
    cannot be written (a read-only mount, another user's) is still read: its lock file is locked through a
    read-only handle (flock asks no more), or where it cannot be opened, not at all where the folder cannot be
    written (nothing is built there; ``meta.json``, renamed in last, vouches for what is read), else refused."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create cache folder {folder}: {e.strerror} (set data.cache_dir or "
                          f"$HYBRIDNORM_CACHE)") from None
    try:
        import fcntl
    except ImportError:  # Windows: atomic renames still keep every file whole
        yield
        return
    try:
        f = open(folder / ".lock", "a")  # closed by the with below, after the block
    except OSError:
        try:
            f = open(folder / ".lock", "rb")
        except OSError as e:
            if os.access(folder, os.W_OK):  # this process may build here: never without the lock the others take
                raise ConfigError(f"cannot open lock file {folder / '.lock'}: {e.strerror}; without it two processes "
                                  "could build this entry at once: chmod a+r it, or set data.cache_dir") from None
            yield  # a read-only folder, where this process builds nothing
            return
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def atomic_file(path: Path, mode: str = "w") -> Iterator[IO]:
    """Write ``path`` all or nothing: into a temporary beside it, made readable by every user (a shared
    cache), renamed over ``path`` only when the block finishes; on any error the temporary is removed, and
    one that a writer killed outright left is removed by the next write (:mod:`hybridnorm.leftovers`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    leftovers.clear_dead(path.parent, path.name, "tmp")
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=leftovers.temp_prefix(path.name, "tmp"), suffix=".tmp")
    try:
        with os.fdopen(fd, mode, encoding=None if "b" in mode else "utf-8") as f:
            yield f
        os.chmod(tmp, CACHE_FILE_MODE)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def atomic_write(path: Path, text: str) -> Path:
    with atomic_file(path) as f:
        f.write(text)
    return path
