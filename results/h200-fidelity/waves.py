"""Per-wave view of reqs.jsonl: closed loop with equal lengths runs in waves of c requests."""
import json, statistics as st, sys
for l in open(sys.argv[1]):
    d = json.loads(l)
    c = d["c"]
    if c < 64:
        continue
    rs = sorted([r for r in d["reqs"] if r["ok"]], key=lambda r: r["start"])
    print(d["who"], "round", d["round"], "c", c)
    for w in range(0, len(rs), c):
        g = rs[w:w + c]
        s = [r["start"] for r in g]; e = [r["start"] + r["latency"] for r in g]
        f = [r["start"] + r["ttft"] for r in g]
        tp = [(r["latency"] - r["ttft"]) / (r["out"] - 1) * 1e3 for r in g]
        print("   wave %d: start %.2f..%.2f  first token %.2f..%.2f  end %.2f..%.2f  TTFT p50 %.0f ms  TPOT p50 %.1f ms"
              % (w // c, min(s), max(s), min(f), max(f), min(e), max(e), st.median(r["ttft"] for r in g) * 1e3,
                 st.median(tp)))
