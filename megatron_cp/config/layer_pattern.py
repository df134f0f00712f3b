"""Per-layer 0/1 patterns: which layers are MoE (``--moe-layer-freq``) and which Gated
DeltaNet (``--linear-attention-freq``), from Megatron-LM's integer or list-expression forms."""
import ast


def parse_layer_freq(freq, num_layers, name="moe_layer_freq", every_kth=None):
    """A per-layer 0/1 pattern flag (``--moe-layer-freq``, ``--linear-attention-freq``) as one
    0/1 per layer. An integer k gives ``every_kth(k, layer)`` (default: 1 on every k-th layer
    from layer 0); a pattern is a Python list expression of 0/1 built from ``[..]``, ``+`` and
    ``*`` (e.g. ``([0]*2+[1]*6)``), one entry per layer. ``name`` names the flag in errors."""
    text = str(freq).strip()
    if text.isdigit():
        k = int(text)
        if k < 1:
            raise ValueError(f"{name} ({freq}) must be >= 1 or a 0/1 pattern")
        rule = every_kth or (lambda k, i: 1 if i % k == 0 else 0)
        return [rule(k, i) for i in range(num_layers)]
    try:
        pattern = _eval_pattern(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError, TypeError):
        pattern = None
    if not isinstance(pattern, list) or any(x not in (0, 1) for x in pattern):
        raise ValueError(f"{name} ({freq}) must be an integer or a 0/1 list such as "
                         f"'([0]*2+[1]*6)'")
    if len(pattern) != num_layers:
        raise ValueError(f"{name} ({freq}) has {len(pattern)} entries for num_layers "
                         f"({num_layers}); give one 0/1 per layer")
    return pattern


def _eval_pattern(node):
    """Evaluate a list expression of int literals, list displays, + and * (nothing else)."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.List):
        return [_eval_pattern(item) for item in node.elts]
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _eval_pattern(node.left), _eval_pattern(node.right)
        return left + right if isinstance(node.op, ast.Add) else left * right
    raise ValueError("not a layer pattern")
