"""The dense work of cpu_noise.py with a fixed small probe (20 128x128 matmuls) timed around each
repetition: does the probe predict the repetition's speed (a control variate for step clocks)?

    python cpu_probe.py
"""
import time, torch, numpy as np
torch.set_num_threads(1)
m = torch.nn.Sequential(*[torch.nn.Linear(512,512) for _ in range(6)])
x = torch.randn(512,512)
opt = torch.optim.SGD(m.parameters(), lr=1e-4)
pa = torch.randn(128,128); pb=torch.randn(128,128)
ts=[]; ps=[]
for i in range(400):
    t=time.thread_time()
    for _ in range(20): pa@pb
    t1=time.thread_time()
    for _ in range(3):
        loss = m(x).square().mean(); loss.backward(); opt.step(); opt.zero_grad()
    t2=time.thread_time()
    for _ in range(20): pa@pb
    t3=time.thread_time()
    ts.append((t2-t1)*1e3); ps.append((t1-t+t3-t2)*1e3)
a=np.array(ts[20:]); p=np.array(ps[20:])
print('main', a.mean(), 'sd%', a.std()/a.mean()*100, 'probe', p.mean(), 'sd%', p.std()/p.mean()*100)
print('corr', np.corrcoef(a,p)[0,1], 'corr log', np.corrcoef(np.log(a),np.log(p))[0,1])
r=a/p*p.mean()
print('normalized sd%', r.std()/r.mean()*100, 'paired diff sd% raw', np.std(a[1::2]-a[0::2])/a.mean()*100, 'normalized', np.std(r[1::2]-r[0::2])/r.mean()*100)
