/*
 * The machine's floor under bench/lease.py's handoff figure, with no Python and no CUDA:
 * two processes take turns on a shared futex word, each holding its turn ~1 ms, so the
 * other is asleep when it is woken. Prints the wake-to-running latency.
 *
 * An argument, in microseconds, is a pause after each release before the releaser waits
 * for its next turn: the turns of bench/lease.py's Python clients, which sleep 300 us
 * after each release (without strict turns, a releaser would take the lease back before
 * the woken waiter runs). The pause alone can move the wake-up: on the 2-core VM it
 * doubles it (10 us against 5), on the H200 machine it did not (22.5 against 26.3).
 *
 *     gcc -O2 -o /tmp/futex_floor bench/futex_floor.c && /tmp/futex_floor [PAUSE_US]
 */
#define _GNU_SOURCE
#include <linux/futex.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
static int64_t now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1000000000LL + t.tv_nsec; }
typedef struct { uint32_t turn; uint32_t pad; int64_t released; int64_t lat[2000]; } shm_t;
static void play(shm_t *s, uint32_t me, int rounds, long pause_ns) {
    for (int i = 0; i < rounds; i++) {
        uint32_t t;
        while ((t = __atomic_load_n(&s->turn, __ATOMIC_ACQUIRE)) != me) syscall(SYS_futex, &s->turn, FUTEX_WAIT, t, NULL, NULL, 0);
        int64_t got = now();
        if (s->released) s->lat[i * 2 + me] = got - s->released;
        struct timespec hold = {0, 1000000}; nanosleep(&hold, NULL);
        s->released = now();
        __atomic_store_n(&s->turn, 1 - me, __ATOMIC_RELEASE);
        syscall(SYS_futex, &s->turn, FUTEX_WAKE, 1, NULL, NULL, 0);
        if (pause_ns) {
            struct timespec pause = {0, pause_ns};
            nanosleep(&pause, NULL);
        }
    }
}
static int cmp(const void *a, const void *b) { int64_t x = *(int64_t *)a, y = *(int64_t *)b; return (x > y) - (x < y); }
int main(int argc, char **argv) {
    long pause_ns = argc > 1 ? atol(argv[1]) * 1000L : 0;
    if (pause_ns < 0 || pause_ns >= 1000000000L) {
        fprintf(stderr, "a pause of 0 to 999999 us, not %s\n", argv[1]);
        return 2;
    }
    shm_t *s = mmap(NULL, sizeof(shm_t), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    int rounds = 1000;
    if (fork() == 0) { play(s, 1, rounds, pause_ns); _exit(0); }
    play(s, 0, rounds, pause_ns);
    wait(NULL);
    int n = 0; static int64_t v[2000];
    for (int i = 0; i < 2000; i++) if (s->lat[i] > 0) v[n++] = s->lat[i];
    qsort(v, n, sizeof(int64_t), cmp);
    printf("C futex handoff after a 1 ms hold: p50 %.1f us, p99 %.1f us over %d\n", v[n / 2] / 1e3, v[n * 99 / 100] / 1e3, n);
    return 0;
}
