/* api/router/routing.py's Router and PrefixTree for byte prompts, and api/router/http_router.py's _routing_of.
 * Every decision, count and eviction equals the Python one (tests/test_native_routing.py). */
#include "route.h"

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

/* ---- the prefix tree ----------------------------------------------------------------------- */

typedef struct node node;

/* What one replica's tree knows of a node. */
typedef struct {
    uint64_t last_used;     /* the insert that last went through it; 0: the replica does not hold it */
    int32_t heap_pos;       /* its place in the replica's LRU heap, -1 unless it is one of the replica's leaves */
    uint32_t held_children; /* children the replica holds: a held node with none is a leaf of its tree */
} holding;

typedef struct {
    uint8_t first; /* child->edge[0], kept here so that a lookup touches one array */
    node *child;
} child_ref;

struct node {
    node *parent;
    const uint8_t *edge; /* the edge from the parent; points into this node's own allocation */
    size_t len;
    child_ref *children; /* sorted by first byte, so at most 256 */
    uint32_t nchildren, cap;
    uint32_t holders;  /* replicas that hold it: a node nobody holds is freed at once */
    holding held[];    /* per replica, followed by the edge bytes */
};

/* One replica's leaves, a binary min-heap on last_used: its least recently used leaf is the next
 * one evicted. Python's heap may also hold stale entries (skipped when popped); this one is kept
 * exact instead, with each node's position in it. */
typedef struct {
    node **items;
    size_t len, cap;
} lru_heap;

typedef struct {
    node *root;
    int replicas;
    int64_t max_tokens;
    uint64_t clock;
    int64_t *size; /* bytes held per replica */
    lru_heap *lru;
} prefix_tree;

/* Where a prompt's way down the tree ended, so that inserting it does not walk again. */
typedef struct {
    size_t *matched; /* per replica: how many leading bytes of the prompt its tree holds */
    node *last;      /* the last node entered (the root if none) */
    size_t depth;    /* bytes matched in all */
    size_t cut;      /* bytes of last's edge matched when the prompt leaves it part way, else 0 */
} walk_result;

static node *node_new(int replicas, const uint8_t *edge, size_t len, node *parent) {
    node *n = malloc(sizeof(node) + (size_t)replicas * sizeof(holding) + len);
    if (n == NULL) return NULL;
    uint8_t *bytes = (uint8_t *)&n->held[replicas];
    if (len) memcpy(bytes, edge, len);
    *n = (node){.parent = parent, .edge = bytes, .len = len};
    for (int r = 0; r < replicas; r++) n->held[r] = (holding){.last_used = 0, .heap_pos = -1, .held_children = 0};
    return n;
}

/* Frees the subtree under `top`, deepest last child first, by parent links: no stack however deep
 * the tree is. Its parent's children array is the caller's to fix. */
static void free_subtree(node *top) {
    node *n = top;
    for (;;) {
        while (n->nchildren) n = n->children[n->nchildren - 1].child;
        node *up = n->parent;
        free(n->children);
        free(n);
        if (n == top) return;
        up->nchildren--;
        n = up;
    }
}

/* The index of the child whose edge starts with `first`, or of where it would go. */
static uint32_t child_slot(const node *n, uint8_t first) {
    uint32_t lo = 0, hi = n->nchildren;
    while (lo < hi) {
        uint32_t mid = (lo + hi) / 2;
        if (n->children[mid].first < first) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

static node *child_of(const node *n, uint8_t first) {
    uint32_t i = child_slot(n, first);
    return i < n->nchildren && n->children[i].first == first ? n->children[i].child : NULL;
}

/* Room for one more child, allocated before the tree changes so that an insert is all or nothing. */
static bool reserve_child(node *n) {
    if (n->nchildren < n->cap) return true;
    uint32_t cap = n->cap ? 2 * n->cap : 2;
    child_ref *grown = realloc(n->children, cap * sizeof(child_ref));
    if (grown == NULL) return false;
    n->children = grown;
    n->cap = cap;
    return true;
}

static void add_child(node *n, node *child) {
    uint32_t i = child_slot(n, child->edge[0]);
    memmove(&n->children[i + 1], &n->children[i], (n->nchildren - i) * sizeof(child_ref));
    n->children[i] = (child_ref){child->edge[0], child};
    n->nchildren++;
}

static void remove_child(node *n, const node *child) {
    uint32_t i = child_slot(n, child->edge[0]);
    memmove(&n->children[i], &n->children[i + 1], (n->nchildren - i - 1) * sizeof(child_ref));
    n->nchildren--;
}

/* ---- the LRU heaps ---- */

static uint64_t heap_key(const lru_heap *h, size_t i, int r) { return h->items[i]->held[r].last_used; }

static void heap_place(lru_heap *h, size_t i, node *n, int r) {
    h->items[i] = n;
    n->held[r].heap_pos = (int32_t)i;
}

static void sift_up(lru_heap *h, size_t i, int r) {
    node *n = h->items[i];
    uint64_t key = n->held[r].last_used;
    while (i > 0 && heap_key(h, (i - 1) / 2, r) > key) {
        heap_place(h, i, h->items[(i - 1) / 2], r);
        i = (i - 1) / 2;
    }
    heap_place(h, i, n, r);
}

static void sift_down(lru_heap *h, size_t i, int r) {
    node *n = h->items[i];
    uint64_t key = n->held[r].last_used;
    for (;;) {
        size_t least = 2 * i + 1;
        if (least >= h->len) break;
        if (least + 1 < h->len && heap_key(h, least + 1, r) < heap_key(h, least, r)) least++;
        if (heap_key(h, least, r) >= key) break;
        heap_place(h, i, h->items[least], r);
        i = least;
    }
    heap_place(h, i, n, r);
}

static bool heap_reserve(lru_heap *h) {
    if (h->len < h->cap) return true;
    size_t cap = h->cap ? 2 * h->cap : 64;
    node **grown = realloc(h->items, cap * sizeof(node *));
    if (grown == NULL) return false;
    h->items = grown;
    h->cap = cap;
    return true;
}

/* Callers have reserved the room (an insert) or just popped an item (an eviction). */
static void heap_push(lru_heap *h, node *n, int r) {
    h->items[h->len] = n;
    sift_up(h, h->len++, r);
}

static void heap_remove(lru_heap *h, node *n, int r) {
    size_t i = (size_t)n->held[r].heap_pos;
    n->held[r].heap_pos = -1;
    node *moved = h->items[--h->len];
    if (moved == n) return;
    heap_place(h, i, moved, r);
    sift_up(h, i, r);
    sift_down(h, (size_t)moved->held[r].heap_pos, r);
}

/* ---- walk, insert, evict ---- */

/* How many leading bytes of `a` and `b` are equal. */
static size_t common_prefix(const uint8_t *a, const uint8_t *b, size_t n) {
    if (memcmp(a, b, n) == 0) return n;
    size_t i = 0;
    while (a[i] == b[i]) i++;
    return i;
}

static void tree_walk(const prefix_tree *t, const uint8_t *prompt, size_t len, walk_result *w) {
    memset(w->matched, 0, (size_t)t->replicas * sizeof(size_t));
    node *n = t->root;
    size_t pos = 0;
    w->last = n;
    w->cut = 0;
    while (pos < len) {
        node *child = child_of(n, prompt[pos]);
        if (child == NULL) break;
        size_t avail = len - pos < child->len ? len - pos : child->len;
        size_t same = common_prefix(child->edge, prompt + pos, avail);
        pos += same;
        for (int r = 0; r < t->replicas; r++)
            if (child->held[r].last_used) w->matched[r] = pos;
        w->last = child;
        if (same < child->len) {
            w->cut = same;
            break;
        }
        n = child;
    }
    w->depth = pos;
}

/* Python's _hold; the replica's heap keeps exactly its leaves. */
static void hold(prefix_tree *t, node *n, int r, uint64_t now) {
    holding *h = &n->held[r];
    if (h->last_used == 0) {
        t->size[r] += (int64_t)n->len;
        n->holders++;
        holding *up = &n->parent->held[r];
        if (up->held_children++ == 0 && up->heap_pos >= 0) heap_remove(&t->lru[r], n->parent, r);
    }
    h->last_used = now;
    if (h->held_children) return;
    if (h->heap_pos >= 0) sift_down(&t->lru[r], (size_t)h->heap_pos, r); /* its key only grew */
    else heap_push(&t->lru[r], n, r);
}

/* Cuts `child`'s edge after `at` bytes into a new upper node, which holds what the child held.
 * `upper` comes allocated (by the caller, before anything changed) with the first `at` bytes. */
static void split(prefix_tree *t, node *child, node *upper) {
    node *parent = child->parent;
    upper->parent = parent;
    upper->holders = child->holders;
    for (int r = 0; r < t->replicas; r++) {
        uint64_t used = child->held[r].last_used;
        upper->held[r] = (holding){.last_used = used, .heap_pos = -1, .held_children = used ? 1 : 0};
    }
    parent->children[child_slot(parent, child->edge[0])].child = upper;
    child->edge += upper->len;
    child->len -= upper->len;
    child->parent = upper;
    upper->children[0] = (child_ref){child->edge[0], child};
    upper->nchildren = 1;
}

/* Python's _evict. Its heap pops (last used, push order) and skips entries that are no longer a
 * leaf's; this one holds each leaf once, ordered by last used alone. The two pick the same leaf
 * because two leaves of one replica never share a last_used: the nodes an insert stamps lie on one
 * root path, a split's upper half copies its child's stamps, and a replica that holds a node
 * holds its parent, so the nodes of one replica with one stamp form a chain with one leaf at most. */
static void evict(prefix_tree *t, int r) {
    lru_heap *h = &t->lru[r];
    while (t->size[r] > t->max_tokens && h->len) {
        node *n = h->items[0];
        heap_remove(h, n, r);
        node *up = n->parent;
        n->held[r].last_used = 0;
        n->holders--;
        t->size[r] -= (int64_t)n->len;
        if (--up->held[r].held_children == 0 && up != t->root) heap_push(h, up, r);
        if (n->holders == 0 && n->nchildren == 0) {
            remove_child(up, n);
            free(n->children);
            free(n);
        }
    }
}

/* Python's insert after a walk: all or nothing, so out of memory it leaves the tree as it was. */
static void tree_insert(prefix_tree *t, const uint8_t *prompt, size_t len, int r, const walk_result *w) {
    node *upper = NULL, *leaf = NULL, *n = w->last;
    bool ok = heap_reserve(&t->lru[r]);
    if (ok && w->cut) {
        upper = node_new(t->replicas, n->edge, w->cut, NULL);
        ok = upper != NULL && reserve_child(upper);
    }
    if (ok && w->depth < len) {
        leaf = node_new(t->replicas, prompt + w->depth, len - w->depth, NULL);
        ok = leaf != NULL && (upper != NULL || reserve_child(n));
    }
    if (!ok) {
        if (upper) free(upper->children);
        free(upper);
        free(leaf);
        return;
    }
    uint64_t now = ++t->clock;
    if (upper) {
        split(t, n, upper);
        n = upper;
    }
    if (leaf) {
        leaf->parent = n;
        add_child(n, leaf);
        n = leaf;
    }
    for (; n != t->root; n = n->parent) hold(t, n, r, now); /* bottom up: only the deepest can be a leaf */
    evict(t, r);
}

/* The pre-order successor of `n`, by parent links. */
static node *next_node(node *n) {
    if (n->nchildren) return n->children[0].child;
    for (node *up = n->parent; up; n = up, up = up->parent) {
        uint32_t i = child_slot(up, n->edge[0]);
        if (i + 1 < up->nchildren) return up->children[i + 1].child;
    }
    return NULL;
}

/* Python's drop_replica and _prune: the nodes only this replica held go with it. A node nobody
 * holds has no holder below it either (holders of a node hold its parent), so its whole subtree
 * goes; the rest only forget the replica. */
static void drop_replica(prefix_tree *t, int r) {
    t->root->held[r].held_children = 0;
    for (node *n = t->root; n; n = next_node(n)) {
        uint32_t kept = 0;
        for (uint32_t i = 0; i < n->nchildren; i++) {
            node *child = n->children[i].child;
            if (child->held[r].last_used) child->holders--;
            child->held[r] = (holding){.last_used = 0, .heap_pos = -1, .held_children = 0};
            if (child->holders) n->children[kept++] = n->children[i];
            else free_subtree(child);
        }
        n->nchildren = kept;
    }
    t->size[r] = 0;
    t->lru[r].len = 0;
}

/* ---- the router ---------------------------------------------------------------------------- */

struct route_router {
    int policy, replicas;
    double cache_threshold, balance_rel_threshold;
    int64_t balance_abs_threshold;
    int64_t *requests, *tokens;
    bool *healthy;
    int *live, nlive; /* the healthy replicas in index order */
    uint64_t turn;
    prefix_tree tree;
    walk_result walk;
};

/* Every node keeps 16 bytes per replica: past a million replicas, a refusal here beats nodes that
 * cannot be allocated later (RouterConfig has no such bound; no router has that many workers). */
enum { MAX_REPLICAS = 1 << 20 };

route_router *route_new(int policy, int num_replicas, double cache_threshold, int64_t balance_abs_threshold,
                        double balance_rel_threshold, int64_t max_tree_tokens) {
    if (policy < ROUTE_CACHE_AWARE || policy > ROUTE_ROUTING_KEY || num_replicas < 1 || num_replicas > MAX_REPLICAS ||
        !(cache_threshold >= 0.0 && cache_threshold <= 1.0) || balance_abs_threshold < 0 ||
        !(balance_rel_threshold >= 1.0) || max_tree_tokens < 1)
        return NULL;
    route_router *rt = calloc(1, sizeof(route_router));
    if (rt == NULL) return NULL;
    size_t n = (size_t)num_replicas;
    *rt = (route_router){
        .policy = policy,
        .replicas = num_replicas,
        .cache_threshold = cache_threshold,
        .balance_rel_threshold = balance_rel_threshold,
        .balance_abs_threshold = balance_abs_threshold,
        .requests = calloc(n, sizeof(int64_t)),
        .tokens = calloc(n, sizeof(int64_t)),
        .healthy = calloc(n, sizeof(bool)),
        .live = calloc(n, sizeof(int)),
        .nlive = num_replicas,
        .tree = {.replicas = num_replicas, .max_tokens = max_tree_tokens, .size = calloc(n, sizeof(int64_t)),
                 .lru = calloc(n, sizeof(lru_heap)), .root = node_new(num_replicas, NULL, 0, NULL)},
        .walk = {.matched = calloc(n, sizeof(size_t))},
    };
    if (!rt->requests || !rt->tokens || !rt->healthy || !rt->live || !rt->tree.size || !rt->tree.lru ||
        !rt->tree.root || !rt->walk.matched) {
        route_free(rt);
        return NULL;
    }
    for (int i = 0; i < num_replicas; i++) {
        rt->healthy[i] = true;
        rt->live[i] = i;
    }
    return rt;
}

void route_free(route_router *rt) {
    if (rt == NULL) return;
    if (rt->tree.root) free_subtree(rt->tree.root);
    if (rt->tree.lru)
        for (int r = 0; r < rt->replicas; r++) free(rt->tree.lru[r].items);
    free(rt->tree.lru);
    free(rt->tree.size);
    free(rt->walk.matched);
    free(rt->requests);
    free(rt->tokens);
    free(rt->healthy);
    free(rt->live);
    free(rt);
}

/* ---- rendezvous hashing: api/router/routing.py's _key_hash and _replica_weight ---- */

static const uint64_t FNV_OFFSET = 0xcbf29ce484222325u, FNV_PRIME = 0x100000001b3u;
static const uint8_t SEPARATOR = 0;

static uint64_t fnv1a(uint64_t h, const uint8_t *bytes, size_t len) {
    for (size_t i = 0; i < len; i++) h = (h ^ bytes[i]) * FNV_PRIME;
    return h;
}

static uint64_t replica_weight(uint64_t keyed, int replica) {
    uint8_t digits[12];
    size_t n = 0;
    do digits[sizeof digits - ++n] = (uint8_t)('0' + replica % 10);
    while ((replica /= 10) > 0);
    uint64_t z = fnv1a(keyed, digits + sizeof digits - n, n);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9u;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebu;
    return z ^ (z >> 31);
}

/* max(live, key=weight): the first of equal weights. */
static int by_key(const route_router *rt, const uint8_t *key, size_t key_len) {
    uint64_t keyed = fnv1a(fnv1a(FNV_OFFSET, key, key_len), &SEPARATOR, 1);
    int best = rt->live[0];
    uint64_t best_weight = replica_weight(keyed, best);
    for (int j = 1; j < rt->nlive; j++) {
        uint64_t weight = replica_weight(keyed, rt->live[j]);
        if (weight > best_weight) best = rt->live[j], best_weight = weight;
    }
    return best;
}

/* min(live, key=(tokens, i)) */
static int shortest_queue(const route_router *rt) {
    int best = rt->live[0];
    for (int j = 1; j < rt->nlive; j++)
        if (rt->tokens[rt->live[j]] < rt->tokens[best]) best = rt->live[j];
    return best;
}

/* Python's `int > float`, which compares exactly, where C would round the integer to a double. */
static bool int_above(int64_t a, double b) {
    if (b != b || b >= 9223372036854775808.0) return false; /* NaN: 0 * inf when the threshold is inf */
    if (b < -9223372036854775808.0) return true;
    double whole = (double)(int64_t)b;     /* b truncated toward zero, exactly */
    int64_t floor = (int64_t)b - (whole > b); /* for an integer a: a > b exactly when a > floor(b) */
    return a > floor;
}

/* Python's _cache_aware. */
static int cache_aware(const route_router *rt, size_t prompt_len, const size_t *matched) {
    const int64_t *req = rt->requests;
    int idlest = rt->live[0];
    int64_t busiest = req[idlest];
    for (int j = 1; j < rt->nlive; j++) {
        int i = rt->live[j];
        if (req[i] < req[idlest]) idlest = i;
        if (req[i] > busiest) busiest = req[i];
    }
    int64_t least = req[idlest];
    if (busiest - least > rt->balance_abs_threshold && int_above(busiest, (double)least * rt->balance_rel_threshold))
        return idlest;
    int best = rt->live[0]; /* max (matched, -requests, -i) */
    for (int j = 1; j < rt->nlive; j++) {
        int i = rt->live[j];
        if (matched[i] > matched[best] || (matched[i] == matched[best] && req[i] < req[best])) best = i;
    }
    if (prompt_len && (double)matched[best] / (double)prompt_len > rt->cache_threshold) return best;
    const int64_t *size = rt->tree.size;
    int smallest = rt->live[0]; /* min (tree size, requests, i) */
    for (int j = 1; j < rt->nlive; j++) {
        int i = rt->live[j];
        if (size[i] < size[smallest] || (size[i] == size[smallest] && req[i] < req[smallest])) smallest = i;
    }
    return smallest;
}

int route_choose(route_router *rt, const uint8_t *prompt, size_t prompt_len, const uint8_t *key, size_t key_len,
                 int has_key) {
    if (rt->nlive == 0) return -1;
    switch (rt->policy) {
    case ROUTE_ROUND_ROBIN:
        return rt->live[rt->turn++ % (uint64_t)rt->nlive];
    case ROUTE_ROUTING_KEY:
        return has_key ? by_key(rt, key, key_len) : shortest_queue(rt);
    case ROUTE_CACHE_AWARE: {
        tree_walk(&rt->tree, prompt, prompt_len, &rt->walk);
        int replica = cache_aware(rt, prompt_len, rt->walk.matched);
        tree_insert(&rt->tree, prompt, prompt_len, replica, &rt->walk);
        return replica;
    }
    default:
        return shortest_queue(rt);
    }
}

static bool known(const route_router *rt, int replica) { return replica >= 0 && replica < rt->replicas; }

/* The load figures are the one thing another thread reads (route_requests, route_tokens: the
 * Python router's /get_server_info), so they are stored and read atomically; one thread writes. */
static void add_load(route_router *rt, int replica, int64_t requests, int64_t tokens) {
    __atomic_store_n(&rt->requests[replica], rt->requests[replica] + requests, __ATOMIC_RELAXED);
    __atomic_store_n(&rt->tokens[replica], rt->tokens[replica] + tokens, __ATOMIC_RELAXED);
}

void route_started(route_router *rt, int replica, int64_t tokens) {
    if (known(rt, replica)) add_load(rt, replica, 1, tokens);
}

void route_finished(route_router *rt, int replica, int64_t tokens) {
    if (known(rt, replica)) add_load(rt, replica, -1, -tokens);
}

void route_set_healthy(route_router *rt, int replica, int healthy) {
    if (!known(rt, replica)) return;
    rt->healthy[replica] = healthy != 0;
    rt->nlive = 0;
    for (int i = 0; i < rt->replicas; i++)
        if (rt->healthy[i]) rt->live[rt->nlive++] = i;
    if (!healthy) drop_replica(&rt->tree, replica); /* what it cached is gone, or stale when it returns */
}

int64_t route_requests(const route_router *rt, int replica) {
    return known(rt, replica) ? __atomic_load_n(&rt->requests[replica], __ATOMIC_RELAXED) : 0;
}

int64_t route_tokens(const route_router *rt, int replica) {
    return known(rt, replica) ? __atomic_load_n(&rt->tokens[replica], __ATOMIC_RELAXED) : 0;
}

int64_t route_tree_size(const route_router *rt, int replica) { return known(rt, replica) ? rt->tree.size[replica] : 0; }

/* ---- route_fields: msgspec's strict JSON, as _routing_of decodes a body ---------------------- */

/* msgspec gives up (RecursionError, which _routing_of does not catch) near Python's recursion
 * limit, 1000 frames less its caller's; beyond this many nested containers the scanner calls the
 * body invalid, so that its own stack stays bounded. */
enum { MAX_DEPTH = 1000 };

typedef struct {
    const uint8_t *p, *end;
} cursor;

/* The next byte after JSON whitespace, false at the end. */
static bool peek(cursor *c, uint8_t *next) {
    while (c->p < c->end && (*c->p == ' ' || *c->p == '\n' || *c->p == '\r' || *c->p == '\t')) c->p++;
    if (c->p == c->end) return false;
    *next = *c->p;
    return true;
}

static int hex_digit(uint8_t ch) {
    if (ch >= '0' && ch <= '9') return ch - '0';
    if (ch >= 'a' && ch <= 'f') return ch - 'a' + 10;
    if (ch >= 'A' && ch <= 'F') return ch - 'A' + 10;
    return -1;
}

static bool read_hex4(cursor *c, uint32_t *out) {
    if (c->end - c->p < 4) return false;
    uint32_t v = 0;
    for (int i = 0; i < 4; i++) {
        int d = hex_digit(*c->p++);
        if (d < 0) return false;
        v = v << 4 | (uint32_t)d;
    }
    *out = v;
    return true;
}

/* A decoded string: the first `cap` bytes go to `out` (none when NULL), `len` counts them all. */
typedef struct {
    uint8_t *out;
    size_t cap, len;
} sink;

static void put(sink *s, const uint8_t *bytes, size_t n) {
    if (s->out && s->len < s->cap) memcpy(s->out + s->len, bytes, n < s->cap - s->len ? n : s->cap - s->len);
    s->len += n;
}

/* A \u escape after its "\u": msgspec takes a surrogate pair as one code point and refuses a lone
 * surrogate (so no string it accepts decodes to invalid UTF-8). */
static bool unicode_escape(cursor *c, sink *s) {
    uint32_t cp, low;
    if (!read_hex4(c, &cp) || (cp >= 0xdc00 && cp <= 0xdfff)) return false;
    if (cp >= 0xd800 && cp <= 0xdbff) {
        if (c->end - c->p < 6 || c->p[0] != '\\' || c->p[1] != 'u') return false;
        c->p += 2;
        if (!read_hex4(c, &low) || low < 0xdc00 || low > 0xdfff) return false;
        cp = 0x10000 + ((cp - 0xd800) << 10 | (low - 0xdc00));
    }
    uint8_t utf8[4];
    size_t n;
    if (cp < 0x80) {
        utf8[0] = (uint8_t)cp, n = 1;
    } else if (cp < 0x800) {
        utf8[0] = (uint8_t)(0xc0 | cp >> 6), utf8[1] = (uint8_t)(0x80 | (cp & 0x3f)), n = 2;
    } else if (cp < 0x10000) {
        utf8[0] = (uint8_t)(0xe0 | cp >> 12), utf8[1] = (uint8_t)(0x80 | (cp >> 6 & 0x3f));
        utf8[2] = (uint8_t)(0x80 | (cp & 0x3f)), n = 3;
    } else {
        utf8[0] = (uint8_t)(0xf0 | cp >> 18), utf8[1] = (uint8_t)(0x80 | (cp >> 12 & 0x3f));
        utf8[2] = (uint8_t)(0x80 | (cp >> 6 & 0x3f)), utf8[3] = (uint8_t)(0x80 | (cp & 0x3f)), n = 4;
    }
    put(s, utf8, n);
    return true;
}

/* A string at its opening quote, decoded into `s`. Like msgspec: control bytes are refused, other
 * bytes pass as they are (it does not check UTF-8 while scanning). */
static bool scan_string(cursor *c, sink *s) {
    static const uint8_t escaped[256] = {['"'] = '"', ['\\'] = '\\', ['/'] = '/', ['b'] = '\b',
                                         ['f'] = '\f', ['n'] = '\n',  ['r'] = '\r', ['t'] = '\t'};
    c->p++;
    for (;;) {
        const uint8_t *run = c->p;
        while (c->p < c->end && *c->p >= 0x20 && *c->p != '"' && *c->p != '\\') c->p++;
        put(s, run, (size_t)(c->p - run));
        if (c->p == c->end || *c->p < 0x20) return false;
        if (*c->p++ == '"') return true;
        if (c->p == c->end) return false;
        uint8_t e = *c->p++;
        if (e == 'u') {
            if (!unicode_escape(c, s)) return false;
        } else if (escaped[e]) {
            put(s, &escaped[e], 1);
        } else {
            return false;
        }
    }
}

static bool skip_digits(cursor *c) {
    const uint8_t *start = c->p;
    while (c->p < c->end && *c->p >= '0' && *c->p <= '9') c->p++;
    return c->p > start;
}

static bool at(const cursor *c, uint8_t ch) { return c->p < c->end && *c->p == ch; }

/* -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)? */
static bool skip_number(cursor *c) {
    if (at(c, '-')) c->p++;
    if (at(c, '0')) {
        c->p++;
        if (c->p < c->end && *c->p >= '0' && *c->p <= '9') return false;
    } else if (!skip_digits(c)) {
        return false;
    }
    if (at(c, '.')) {
        c->p++;
        if (!skip_digits(c)) return false;
    }
    if (at(c, 'e') || at(c, 'E')) {
        c->p++;
        if (at(c, '+') || at(c, '-')) c->p++;
        if (!skip_digits(c)) return false;
    }
    return true;
}

static bool skip_word(cursor *c, const char *word) {
    size_t n = strlen(word);
    if ((size_t)(c->end - c->p) < n || memcmp(c->p, word, n) != 0) return false;
    c->p += n;
    return true;
}

static bool skip_value(cursor *c, int depth);

/* Token ids, the bulk of most bodies, as encoders write them: [1-9][0-9]* and a comma. Takes the
 * id and its comma, or nothing (the full grammar then takes the element): a loop this tight
 * skips W2's bodies several times faster than the grammar does. */
static bool skip_plain_id(cursor *c) {
    const uint8_t *p = c->p;
    if (p == c->end || *p < '1' || *p > '9') return false;
    do p++;
    while (p < c->end && *p >= '0' && *p <= '9');
    if (p == c->end || *p != ',') return false;
    c->p = p + 1;
    return true;
}

/* The members or elements of an object or array after its opening bracket. `on_member`, when
 * set, is told each member of an object and takes its value. */
typedef bool (*member_fn)(cursor *c, const uint8_t *key, size_t key_len, void *ctx);

static bool scan_container(cursor *c, int depth, bool object, member_fn on_member, void *ctx) {
    const uint8_t close = object ? '}' : ']';
    uint8_t next;
    if (depth > MAX_DEPTH) return false;
    c->p++;
    if (!peek(c, &next)) return false;
    if (next == close) {
        c->p++;
        return true;
    }
    for (;;) {
        if (object) {
            uint8_t key[16]; /* longer than any field name: it only has to tell them apart */
            sink name = {key, sizeof key, 0};
            if (!peek(c, &next) || next != '"' || !scan_string(c, &name)) return false;
            if (!peek(c, &next) || next != ':') return false;
            c->p++;
            bool ok = on_member && name.len <= sizeof key ? on_member(c, key, name.len, ctx) : skip_value(c, depth);
            if (!ok) return false;
        } else {
            while (skip_plain_id(c)) continue;
            if (!skip_value(c, depth)) return false;
        }
        if (!peek(c, &next)) return false;
        c->p++;
        if (next == close) return true;
        if (next != ',') return false;
    }
}

static bool skip_value(cursor *c, int depth) {
    uint8_t next;
    if (!peek(c, &next)) return false;
    switch (next) {
    case '"': {
        sink none = {NULL, 0, 0};
        return scan_string(c, &none);
    }
    case '{': return scan_container(c, depth + 1, true, NULL, NULL);
    case '[': return scan_container(c, depth + 1, false, NULL, NULL);
    case 'n': return skip_word(c, "null");
    case 't': return skip_word(c, "true");
    case 'f': return skip_word(c, "false");
    default: return skip_number(c);
    }
}

/* _RoutingFields: each field's raw JSON value; a key given twice keeps its last value, as msgspec
 * sets the field again. */
enum { INPUT_IDS, PROMPT, TEXT, MESSAGES, ROUTING_KEY, NFIELDS };
static const struct {
    const char *name;
    size_t len;
} FIELDS[NFIELDS] = {{"input_ids", 9}, {"prompt", 6}, {"text", 4}, {"messages", 8}, {"routing_key", 11}};

typedef struct {
    const uint8_t *value[NFIELDS];
    size_t len[NFIELDS];
} raw_fields;

static bool on_field(cursor *c, const uint8_t *key, size_t key_len, void *ctx) {
    raw_fields *f = ctx;
    for (int i = 0; i < NFIELDS; i++) {
        if (FIELDS[i].len == key_len && memcmp(FIELDS[i].name, key, key_len) == 0) {
            uint8_t next;
            if (!peek(c, &next)) return false;
            const uint8_t *start = c->p;
            if (!skip_value(c, 1)) return false;
            f->value[i] = start;
            f->len[i] = (size_t)(c->p - start);
            return true;
        }
    }
    return skip_value(c, 1);
}

/* Python's strict UTF-8 decoder: no overlong forms, no surrogates, nothing above U+10FFFF. */
static bool valid_utf8(const uint8_t *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        uint8_t b = s[i];
        size_t more;
        uint8_t lo = 0x80, hi = 0xbf; /* the range of the second byte */
        if (b < 0x80) more = 0;
        else if (b >= 0xc2 && b <= 0xdf) more = 1;
        else if (b >= 0xe0 && b <= 0xef) more = 2, lo = b == 0xe0 ? 0xa0 : 0x80, hi = b == 0xed ? 0x9f : 0xbf;
        else if (b >= 0xf0 && b <= 0xf4) more = 3, lo = b == 0xf0 ? 0x90 : 0x80, hi = b == 0xf4 ? 0x8f : 0xbf;
        else return false;
        if (n - i - 1 < more) return false;
        for (size_t k = 1; k <= more; k++) {
            uint8_t cont = s[i + k];
            if (k == 1 ? cont < lo || cont > hi : cont < 0x80 || cont > 0xbf) return false;
        }
        i += more + 1;
    }
    return true;
}

/* The routing key when the raw value is a string. _routing_of raises (UnicodeDecodeError) on a key
 * whose bytes are not UTF-8; here such a key, like one longer than the buffer, counts as none. */
static bool routing_key(const uint8_t *raw, size_t raw_len, uint8_t *key_buf, size_t key_cap, size_t *key_len) {
    if (raw_len == 0 || raw[0] != '"') return false;
    cursor c = {raw, raw + raw_len};
    sink key = {key_buf, key_cap, 0};
    if (!scan_string(&c, &key) || key.len > key_cap || !valid_utf8(key_buf, key.len)) return false;
    *key_len = key.len;
    return true;
}

int route_fields(const uint8_t *body, size_t body_len, const uint8_t **prompt, size_t *prompt_len, uint8_t *key_buf,
                 size_t key_cap, size_t *key_len) {
    *prompt = body;
    *prompt_len = 0;
    *key_len = 0;
    cursor c = {body, body + body_len};
    raw_fields f = {{NULL}, {0}};
    uint8_t next;
    if (!peek(&c, &next) || next != '{' || !scan_container(&c, 1, true, on_field, &f)) return 0;
    if (peek(&c, &next)) return 0; /* only whitespace may follow */
    for (int i = INPUT_IDS; i <= MESSAGES; i++) {
        if (f.len[i]) {
            *prompt = f.value[i];
            *prompt_len = f.len[i];
            break;
        }
    }
    return routing_key(f.value[ROUTING_KEY], f.len[ROUTING_KEY], key_buf, key_cap, key_len);
}
