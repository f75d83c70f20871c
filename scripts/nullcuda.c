/* A libcuda.so.1 whose calls cudafut's native core makes do nothing: for
   measuring host costs on a machine without a GPU. null_calls counts them.
   null_query_lag >= 0 models a GPU that trails the host: an event reads
   pending until that many more records were made after its own (else every
   query answers null_query_status). */
#include <stdlib.h>
long null_calls[6];
int null_query_status = 600;
long null_query_lag = -1;
static long next_event = 0x10000;
static long records = 0;
static long *stamps = NULL; /* per event made here: the record count at its last record */
static long nstamps = 0;
static long *stamp_of(void *e) {
  long i = ((long)e - 0x10000) / 16;
  if (i < 0) return NULL;
  if (i >= nstamps) {
    long n = nstamps ? 2 * nstamps : 4096;
    while (n <= i) n *= 2;
    long *grown = realloc(stamps, n * sizeof(long));
    if (!grown) return NULL;
    for (long j = nstamps; j < n; j++) grown[j] = 0;
    stamps = grown;
    nstamps = n;
  }
  return &stamps[i];
}
int cuEventRecord(void *e, void *s) {
  null_calls[0]++;
  records++;
  if (null_query_lag >= 0) {
    long *st = stamp_of(e);
    if (st) *st = records;
  }
  return 0;
}
int cuEventQuery(void *e) {
  null_calls[1]++;
  if (null_query_lag >= 0) {
    long *st = stamp_of(e);
    return st && records - *st < null_query_lag ? 600 : 0;
  }
  return null_query_status;
}
int cuStreamWaitEvent(void *s, void *e, unsigned f) { null_calls[2]++; return 0; }
int cuCtxGetDevice(int *d) { null_calls[3]++; *d = 0; return 0; }
int cuCtxGetCurrent(void **c) { *c = (void *)0x1000; return 0; }
int cuEventCreate(void **e, unsigned f) { null_calls[4]++; *e = (void *)(next_event += 16); return 0; }
int cuEventDestroy_v2(void *e) { null_calls[5]++; return 0; }
