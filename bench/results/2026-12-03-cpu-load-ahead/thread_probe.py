# One micro-batch of 4,096 tokens at DeepSeek-V3 width read by train_data.read_batch (pageable memory):
# timed in the main thread, in a worker thread, and in the main thread keeping each read alive.
# Run from the repository root: .venv/bin/python bench/results/2026-12-03-cpu-load-ahead/thread_probe.py
import sys, time, numpy as np, torch, tempfile, threading
sys.path.insert(0, 'bench')
from load_ahead import write_store
from eaglet.formats.store import StoreReader
from eaglet.training.data import epoch_plan, read_batch
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor
folder = Path(tempfile.mkdtemp())
lengths = write_store(folder, 7168, 4096 * 12)
store = StoreReader(folder)
plan = epoch_plan(np.array(sorted(lengths)), lengths, 4096, seed=0, epoch=0)[:11]
def read(ids):
    t = time.perf_counter(); h = read_batch(store, ids, max_tokens=4096, pin=False, ttt_steps=7); return time.perf_counter() - t, h
for ids in plan: read(ids)
main = [round(1e3*read(ids)[0]) for ids in plan]
pool = ThreadPoolExecutor(1)
thr = [round(1e3*pool.submit(read, ids).result()[0]) for ids in plan]
keep = []
main_keep = []
for ids in plan:
    d, h = read(ids); main_keep.append(round(1e3*d)); keep.append(h)
print('main', main); print('thread', thr); print('main, kept alive', main_keep, torch.get_num_threads())
