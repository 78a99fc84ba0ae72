"""Why the demo's third answer depends on the decode path: the logits after a call prefix, fed one row at a time
and as one batch, on the llama.cpp backend (Qwen2.5-Coder-0.5B as shipped, one thread). Prints the top tokens of
each and the largest logit difference. Usage: ``python scripts/near_tie_probe.py`` (docs/benchmarks.md, "The demo's
third question is a near-tie").
"""
import sys, numpy as np
sys.path.insert(0, str(__import__('pathlib').Path(__file__).resolve().parent.parent))
from agent import Agent
from agent.demo_tools import TOOLS
import llama_cpp
ag = Agent(tools=TOOLS, threads=1)
eng = ag.engine
tools = list(ag.registry)
msgs = [{"role": "user", "content": "How many feet are in 5 km?"}]
ids = ag.format.render(msgs, tools)  # the prompt the agent's first turn decodes after
tok = eng.tokenizer
cont = '<tool_call>\n{"name": "convert_length", "arguments": {"value": 5'
cids = tok.encode(cont, add_special_tokens=False)
print("prompt", len(ids), "cont", [tok.decode([c]) for c in cids])
from decoding.loader import locate_gguf, KNOWN_MODELS
path = str(locate_gguf(KNOWN_MODELS['qwen2.5-coder-0.5b']))
def run(batch_rows):
    llm = llama_cpp.Llama(model_path=path, n_ctx=2048, n_threads=1, n_batch=512, logits_all=True, verbose=False)
    llm.eval(ids)
    seq = cids
    if batch_rows:
        llm.eval(seq)
    else:
        for t in seq: llm.eval([t])
    return np.array(llm.scores[llm.n_tokens - 1])
a = run(False); b = run(True)
for name, l in (("one row at a time", a), ("one batch", b)):
    top = np.argsort(-l)[:6]
    print(name, [(tok.decode([t]), round(float(l[t]), 3)) for t in top])
print("max diff", float(np.abs(a-b).max()))
