#!/usr/bin/env python3
"""Thread-level emulation of kernels_fused.cu `attention_group_split_merge` (+ `merge_head`): the
kernel's index maps (tile loads, score lanes/warps, value columns/heads, the split partials and
their merge) transcribed line by line and run for all 256 threads phase by phase between the
barriers, against numpy attention in float64. Written in session 27, when no GPU was lent, to
check the kernel's logic without a device. usage: python3 scripts/emulate_group_attention.py
"""
# Thread-level emulation of kernels_fused.cu attention_group_split_merge (+ merge_head) vs a
# numpy reference. Phases between __syncthreads are run for all 256 threads in turn.
import numpy as np, math
GT=32
def split_chunk(L, chunk, S):
    c=(L+S-1)//S; c=max(32,(c+15)&~15); return min(c,chunk)
def emulate(Q,K,V,heads,kvh,dk,dv,pos,n,S,chunk,scale):
    G=heads//kvh; dk4=dk//4; dv4=dv//4; sk=dk+4
    PM=np.zeros((n,heads,S),np.float32); PL=np.zeros((n,heads,S),np.float32); PO=np.zeros((n,heads,S,dv),np.float32)
    O=np.zeros((n,heads*dv),np.float32)
    for g in range(kvh):
      for t in range(n):
        for s in range(S):
          L=pos+t+1; ch=split_chunk(L,chunk,S); j0=s*ch; j1=min(L,j0+ch)
          qs=np.zeros((G,sk),np.float32)
          for i in range(G*dk4):
              h=i//dk4; c=i%dk4; qs[h,4*c:4*c+4]=Q[t,(g*G+h)*dk+4*c:(g*G+h)*dk+4*c+4]
          Ks=np.zeros((GT,sk),np.float32); Vs=np.zeros((GT,dv),np.float32); Ss=np.zeros((G,GT+1),np.float32); Al=np.zeros(G,np.float32)
          acc=np.zeros((256,4),np.float32); mrun=np.full(8,-np.inf,np.float32); lrun=np.zeros(8,np.float32)
          def load(k0):
              kr=[[None]*4 for _ in range(256)]; vr=[[None]*4 for _ in range(256)]
              for tid in range(256):
                  for u in range(4):
                      i=tid+256*u; rk=i//dk4; ck=i%dk4; rv=i//dv4; cv=i%dv4
                      kr[tid][u]=K[k0+rk,g*dk+4*ck:g*dk+4*ck+4].copy() if (rk<GT and k0+rk<j1) else np.zeros(4,np.float32)
                      vr[tid][u]=V[k0+rv,g*dv+4*cv:g*dv+4*cv+4].copy() if (rv<GT and k0+rv<j1) else np.zeros(4,np.float32)
              return kr,vr
          if j0<j1: kr,vr=load(j0)
          k0=j0
          while k0<j1:
              for tid in range(256):
                  for u in range(4):
                      i=tid+256*u; rk=i//dk4; ck=i%dk4; rv=i//dv4; cv=i%dv4
                      if rk<GT: Ks[rk,4*ck:4*ck+4]=kr[tid][u]
                      if rv<GT: Vs[rv,4*cv:4*cv+4]=vr[tid][u]
              if k0+GT<j1: kr,vr=load(k0+GT)
              nk=min(GT,j1-k0)
              for wp in range(min(8,G)):
                  sc=np.full(32,-np.inf,np.float32)
                  for lane in range(nk):
                      a=np.float32(0)
                      for c in range(dk4):
                          x=qs[wp,4*c:4*c+4]; y=Ks[lane,4*c:4*c+4]; a=np.float32(a+(x*y).sum(dtype=np.float32))
                      sc[lane]=a*np.float32(scale)
                  mt=sc.max(); mnew=max(mrun[wp],mt); alpha=np.float32(math.exp(mrun[wp]-mnew)) if mrun[wp]!=-np.inf else np.float32(0)
                  p=np.array([math.exp(sc[l]-mnew) if l<nk else 0.0 for l in range(32)],np.float32)
                  Ss[wp,:32]=p; lrun[wp]=lrun[wp]*alpha+p.sum(dtype=np.float32); mrun[wp]=mnew; Al[wp]=alpha
              for tid in range(256):
                  vd=tid&127; vh0=tid>>7
                  if vd<dv:
                      for i in range(4):
                          h=vh0+2*i
                          if h<G:
                              a=acc[tid,i]*Al[h]
                              for j in range(nk): a=np.float32(a+Ss[h,j]*Vs[j,vd])
                              acc[tid,i]=a
              k0+=GT
          for wp in range(min(8,G)):
              PM[t,g*G+wp,s]=mrun[wp] if j0<j1 else -np.inf; PL[t,g*G+wp,s]=lrun[wp] if j0<j1 else 0
          if j0<j1:
              for tid in range(256):
                  vd=tid&127; vh0=tid>>7
                  if vd<dv:
                      for i in range(4):
                          h=vh0+2*i
                          if h<G: PO[t,g*G+h,s,vd]=acc[tid,i]
      # merge
      for t in range(n):
        L=pos+t+1; ch=split_chunk(L,chunk,S); Sact=min(S,(L+ch-1)//ch)
        for h in range(G):
          hh=g*G+h; m=max(PM[t,hh,s] for s in range(Sact))
          l=sum(PL[t,hh,s]*math.exp(PM[t,hh,s]-m) for s in range(Sact) if PL[t,hh,s]>0)
          for d in range(dv):
              a=sum(PO[t,hh,s,d]*math.exp(PM[t,hh,s]-m) for s in range(Sact) if PL[t,hh,s]>0)
              O[t,hh*dv+d]=a/l
    return O
def reference(Q,K,V,heads,kvh,dk,dv,pos,n,scale):
    G=heads//kvh; O=np.zeros((n,heads*dv))
    for t in range(n):
        L=pos+t+1
        for hh in range(heads):
            g=hh//G; q=Q[t,hh*dk:(hh+1)*dk].astype(np.float64)
            k=K[:L,g*dk:(g+1)*dk].astype(np.float64); v=V[:L,g*dv:(g+1)*dv].astype(np.float64)
            sc=k@q*scale; p=np.exp(sc-sc.max()); p/=p.sum(); O[t,hh*dv:(hh+1)*dv]=p@v
    return O
rng=np.random.default_rng(1)
for (heads,kvh,dk,dv,pos,n,ctx) in [(8,2,16,16,70,2,256),(8,4,8,12,130,3,512),(8,1,128,128,900,1,1024),(16,2,128,128,300,2,1024)]:
    S=min(64,max(1,-(-ctx//64))); chunk=min(-(-ctx//S),8192); S=-(-ctx//chunk)
    Q=rng.standard_normal((n,heads*dk)).astype(np.float32)
    K=rng.standard_normal((ctx,kvh*dk)).astype(np.float32); V=rng.standard_normal((ctx,kvh*dv)).astype(np.float32)
    sc=1/math.sqrt(dk)
    a=emulate(Q,K,V,heads,kvh,dk,dv,pos,n,S,chunk,sc); b=reference(Q,K,V,heads,kvh,dk,dv,pos,n,sc)
    print(heads,kvh,dk,dv,pos,n,'S',S,'chunk',chunk,'max|d|',abs(a-b).max())
