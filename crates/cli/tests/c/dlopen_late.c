/* Loads libraries after start, as a JVM, Python or a plugin host does, while its heap is on a
 * netram region: the dynamic loader's own blocks for them (link maps, names, scopes) must be
 * kept off the region, which the fault handler cannot fault on. Then pushes everything out
 * (writes eight times the budget and reads it back) and uses the libraries.
 *
 * Usage: dlopen_late [MIB] (the region's local budget, 8 by default). Prints "dlopen_late: ok". */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <link.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int (*on_region)(const void *);

static int fail(const char *what, const char *lib) {
    printf("dlopen_late: %s %s\n", what, lib);
    return 1;
}

static void *in_thread(void *arg) {
    /* A thread started after the loads: its thread-local table is the loader's too. */
    double (*cosine)(double) = (double (*)(double))dlsym(arg, "cos");
    return cosine && cosine(0.0) == 1.0 ? arg : NULL;
}

int main(int argc, char **argv) {
    size_t budget = (size_t)(argc > 1 ? atoi(argv[1]) : 8) << 20;
    on_region = (int (*)(const void *))dlsym(RTLD_DEFAULT, "netram_run_on_region");
    if (!on_region) return fail("not under netram run:", "netram_run_on_region missing");
    /* The check can fail: the program's own blocks are on the region (as root, every size). */
    char *probe = malloc(64);
    if (!on_region(probe)) return fail("a block of the program is not on the region", "");
    const char *libs[] = {"libz.so.1", "libresolv.so.2", "libcrypt.so.1", "libm.so.6", "libstdc++.so.6"};
    void *handles[5];
    for (int i = 0; i < 5; i++) {
        handles[i] = dlopen(libs[i], RTLD_NOW | RTLD_GLOBAL);
        if (!handles[i]) return fail("cannot load", dlerror());
        struct link_map *map = NULL;
        if (dlinfo(handles[i], RTLD_DI_LINKMAP, &map) != 0 || !map) return fail("no link map for", libs[i]);
        if (on_region(map)) return fail("the loader's link map on the region:", libs[i]);
        if (on_region(map->l_name)) return fail("the loader's name on the region:", libs[i]);
    }
    pthread_t t;
    void *r = NULL;
    if (pthread_create(&t, NULL, in_thread, handles[3]) != 0 || pthread_join(t, &r) != 0 || r != handles[3])
        return fail("a thread after the loads failed", "");
    /* Everything out: eight budgets written, then checked (fetched back by the handler). */
    size_t n = budget * 8;
    unsigned char *p = malloc(n);
    if (!p || !on_region(p)) return fail("no large block on the region", "");
    for (size_t i = 0; i < n; i += 4096) p[i] = (unsigned char)(i / 4096 * 13 + 5);
    for (size_t i = 0; i < n; i += 4096)
        if (p[i] != (unsigned char)(i / 4096 * 13 + 5)) return fail("wrong contents at", "a page");
    /* The libraries still work, and a late one loads. */
    const char *(*zversion)(void) = (const char *(*)(void))dlsym(handles[0], "zlibVersion");
    if (!zversion || strncmp(zversion(), "1.", 2) != 0) return fail("zlibVersion failed", "");
    void *late = dlopen("libutil.so.1", RTLD_NOW);
    if (late) dlclose(late);
    for (int i = 4; i >= 0; i--) dlclose(handles[i]);
    free(p);
    free(probe);
    printf("dlopen_late: ok\n");
    return 0;
}
