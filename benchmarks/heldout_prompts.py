"""Prompts from the demo model's held-out standard-library files, in three kinds.

- copy:  the tail of a file cut where the next lines repeat lines the prompt already holds;
- edit:  a function, an instruction-like comment, then the function's first lines again;
- plain: the lines of a file from its middle, a continuation with no planted repetition.

Held-out files: the demo corpus's (numaserve/demo_corpus.py), the rule training used.
"""

import ast

from numaserve.demo_corpus import heldout_files

EDIT_COMMENT = "\n\n# Same function again, with clearer variable names:\n"
KINDS = ("copy", "edit", "plain")


def _fit(tokenizer, lines: list[str], max_tokens: int, from_end: bool) -> str:
    """The most whole lines (from the end or the start) whose tokens fit in max_tokens."""
    take = []
    for line in (reversed(lines) if from_end else lines):
        candidate = [line] + take if from_end else take + [line]
        if len(tokenizer.encode("\n".join(candidate))) > max_tokens:
            break
        take = candidate
    return "\n".join(take)


def copy_prompt(tokenizer, text: str, max_tokens: int, look_ahead: int = 6) -> str | None:
    """Cut where most of the next `look_ahead` non-trivial lines already occur in the prompt's window."""
    lines = text.splitlines()
    best, best_score = None, 0.5  # at least half of the continuation must be repeated lines
    window = max_tokens * 3  # characters: a cheap bound on the prompt window before tokenizing
    for cut in range(8, len(lines) - look_ahead):
        ahead = [s.strip() for s in lines[cut:cut + look_ahead * 2] if len(s.strip()) > 3][:look_ahead]
        if len(ahead) < look_ahead:
            continue
        start, size = cut, 0
        while start > 0 and size + len(lines[start - 1]) < window:
            start -= 1
            size += len(lines[start]) + 1
        seen = {s.strip() for s in lines[start:cut]}
        score = sum(a in seen for a in ahead) / len(ahead)
        if score > best_score:
            best, best_score = cut, score
    if best is None:
        return None
    return _fit(tokenizer, lines[:best], max_tokens, from_end=True) + "\n"


def edit_prompt(tokenizer, text: str, max_tokens: int) -> str | None:
    """The first top-level or method function that fits, restated after an instruction-like comment."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return None
    lines = text.splitlines()
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.end_lineno - node.lineno < 5:
            continue
        body = lines[node.lineno - 1:node.end_lineno]
        indent = len(body[0]) - len(body[0].lstrip())
        body = [line[indent:] for line in body]
        prompt = "\n".join(body) + EDIT_COMMENT + "\n".join(body[:2]) + "\n"
        if len(tokenizer.encode(prompt)) <= max_tokens:
            return prompt
    return None


def plain_prompt(tokenizer, text: str, max_tokens: int) -> str | None:
    lines = text.splitlines()
    if len(lines) < 40:
        return None
    return _fit(tokenizer, lines[len(lines) // 2:], max_tokens, from_end=False) + "\n"


def build_prompts(tokenizer, kind: str, num_prompts: int, max_tokens: int) -> list[str]:
    """`num_prompts` prompts of one kind, at most one per held-out file, in file order."""
    make = {"copy": copy_prompt, "edit": edit_prompt, "plain": plain_prompt}[kind]
    prompts = []
    for _, text in heldout_files():
        prompt = make(tokenizer, text, max_tokens)
        if prompt and prompt.strip():
            prompts.append(prompt)
            if len(prompts) == num_prompts:
                break
    return prompts
