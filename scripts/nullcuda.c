/* A libcuda.so.1 whose calls cudafut's native core makes do nothing: for
   measuring host costs on a machine without a GPU. null_calls counts them. */
#include <stdlib.h>
long null_calls[6];
int null_query_status = 600;
static long next_event = 0x10000;
int cuEventRecord(void *e, void *s) { null_calls[0]++; return 0; }
int cuEventQuery(void *e) { null_calls[1]++; return null_query_status; }
int cuStreamWaitEvent(void *s, void *e, unsigned f) { null_calls[2]++; return 0; }
int cuCtxGetDevice(int *d) { null_calls[3]++; *d = 0; return 0; }
int cuCtxGetCurrent(void **c) { *c = (void *)0x1000; return 0; }
int cuEventCreate(void **e, unsigned f) { null_calls[4]++; *e = (void *)(next_event += 16); return 0; }
int cuEventDestroy_v2(void *e) { null_calls[5]++; return 0; }
