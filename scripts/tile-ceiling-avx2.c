// The AVX2 Q4_K tile's inner pattern alone (docs/PERFORMANCE.md, session 38): per token and
// 32-element step, four 8-byte activation broadcasts against four registers of four rows'
// nibbles, four maddubs, three i16 adds, one madd by the scales and one i32 add; nibbles read
// from memory (as the tile does) or held in registers. Build and run:
//   gcc -O2 -mavx2 scripts/tile-ceiling-avx2.c -o /tmp/tc && /tmp/tc
#include <immintrin.h>
#include <stdio.h>
#include <stdint.h>
#include <x86intrin.h>
#define N 20000000L
static int8_t act[16*256] __attribute__((aligned(64)));
static __m256i nibs[8][4];
__attribute__((noinline)) void variant_mem(long n, __m256i *out) {
  __m256i acc[4]; for(int i=0;i<4;i++) acc[i]=_mm256_setzero_si256();
  __m256i s=_mm256_set1_epi16(3);
  for(long it=0; it<n; it++){
    for(int kh=0; kh<8; kh++){
      for(int u=0;u<4;u++){
        const int8_t* x = act + u*256 + 32*kh;
        __m256i p01=_mm256_add_epi16(_mm256_maddubs_epi16(nibs[kh][0], _mm256_set1_epi64x(*(const long long*)x)), _mm256_maddubs_epi16(nibs[kh][1], _mm256_set1_epi64x(*(const long long*)(x+8))));
        __m256i p23=_mm256_add_epi16(_mm256_maddubs_epi16(nibs[kh][2], _mm256_set1_epi64x(*(const long long*)(x+16))), _mm256_maddubs_epi16(nibs[kh][3], _mm256_set1_epi64x(*(const long long*)(x+24))));
        acc[u]=_mm256_add_epi32(acc[u], _mm256_madd_epi16(_mm256_add_epi16(p01,p23), s));
      }
    }
    __asm__ volatile("" ::: "memory");
  }
  for(int i=0;i<4;i++) out[i]=acc[i];
}
__attribute__((noinline)) void variant_reg(long n, __m256i *out) {
  // nibbles in registers for a kh, tokens inner (4 tokens)
  __m256i acc[4]; for(int i=0;i<4;i++) acc[i]=_mm256_setzero_si256();
  __m256i s=_mm256_set1_epi16(3);
  for(long it=0; it<n; it++){
    for(int kh=0; kh<8; kh++){
      __m256i n0=nibs[kh][0],n1=nibs[kh][1],n2=nibs[kh][2],n3=nibs[kh][3];
      for(int u=0;u<4;u++){
        const int8_t* x = act + u*256 + 32*kh;
        __m256i p01=_mm256_add_epi16(_mm256_maddubs_epi16(n0, _mm256_set1_epi64x(*(const long long*)x)), _mm256_maddubs_epi16(n1, _mm256_set1_epi64x(*(const long long*)(x+8))));
        __m256i p23=_mm256_add_epi16(_mm256_maddubs_epi16(n2, _mm256_set1_epi64x(*(const long long*)(x+16))), _mm256_maddubs_epi16(n3, _mm256_set1_epi64x(*(const long long*)(x+24))));
        acc[u]=_mm256_add_epi32(acc[u], _mm256_madd_epi16(_mm256_add_epi16(p01,p23), s));
      }
    }
    __asm__ volatile("" ::: "memory");
  }
  for(int i=0;i<4;i++) out[i]=acc[i];
}
int main(){
  for(int i=0;i<16*256;i++) act[i]=(int8_t)(i*7);
  for(int k=0;k<8;k++) for(int g=0;g<4;g++) nibs[k][g]=_mm256_set1_epi8(k+g);
  __m256i o[4];
  for(int r=0;r<2;r++){
  uint64_t t0=__rdtsc(); variant_mem(N,o); uint64_t t1=__rdtsc();
  double per = (double)(t1-t0)/(N*8.0*4.0);
  printf("mem nibs: %.3f ticks per 128 MACs -> %.1f GMAC/s at 2.45 GHz TSC\n", per, 128.0/per*2.45);
  t0=__rdtsc(); variant_reg(N,o); t1=__rdtsc();
  per = (double)(t1-t0)/(N*8.0*4.0);
  printf("reg nibs: %.3f ticks per 128 MACs -> %.1f GMAC/s\n", per, 128.0/per*2.45);
  }
  printf("%d\n", _mm256_extract_epi32(o[0],0));
}
