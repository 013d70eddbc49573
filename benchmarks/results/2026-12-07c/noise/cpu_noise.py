"""One process, one thread, the same dense work (six 512x512 linear layers, forward, backward and
SGD, three times) 400 times: how much its thread CPU time varies from one repetition to the next
on this host, and how much of that pairs of neighbours cancel.

    python cpu_noise.py
"""
import time, torch, numpy as np
torch.set_num_threads(1)
m = torch.nn.Sequential(*[torch.nn.Linear(512,512) for _ in range(6)])
x = torch.randn(512,512)
opt = torch.optim.SGD(m.parameters(), lr=1e-4)
ts=[]
for i in range(400):
    t=time.thread_time()
    for _ in range(3):
        loss = m(x).square().mean(); loss.backward(); opt.step(); opt.zero_grad()
    ts.append((time.thread_time()-t)*1e3)
a=np.array(ts[20:]); d=a-a.mean()
print('median', np.median(a), 'IQR', np.percentile(a,25), np.percentile(a,75), 'sd%', a.std()/a.mean()*100)
print('lag1 ac', (d[1:]*d[:-1]).mean()/d.var(), 'lag5', (d[5:]*d[:-5]).mean()/d.var())
print('paired-diff sd%', np.std(a[1::2]-a[0::2])/a.mean()*100)
