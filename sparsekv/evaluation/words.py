"""Built-in English word lists for synthetic tasks (no download, no extra package).

RULER (arXiv 2404.06654) draws keys and list words from an English vocabulary; these short,
common words keep that shape offline. Adjectives and nouns are disjoint, so an
``adjective-noun`` key never collides with a single list word.
"""

ADJECTIVES: tuple[str, ...] = tuple(
    """
able absent active adept agile alert amber ample ancient angry apt arctic ardent arid avid
awake bald balmy bare basic bitter bland blank bleak blind blond blue blunt bold brash brave
brief bright brisk broad brown bumpy busy calm candid cheap chief chilly civic clean clear
clever close cloudy coarse cold cosmic crisp cruel curly cute damp dark dear deep dense dim
dirty dizzy dry dull dusty eager early earthy easy eerie elder empty equal exact faint fair
false famous fancy fast fatal feral fierce fine firm flat fluffy foggy fond formal frail
frank free fresh frosty full funny fuzzy gentle giant glad glossy golden good grand gray
great green grim gross hairy happy hardy harsh hasty heavy hidden high hollow honest humble
hungry icy idle jolly keen kind large late lazy lean light lively livid local lofty lonely
long loud loyal lucky lumpy mad major mellow merry mighty mild minor misty modern modest
moist moody muddy mute narrow nasty neat nervous new nice noble noisy normal novel numb odd
old open orange pale perky plain plump polite poor proud pure purple quick quiet rapid rare
raw ready real red regal rich rigid ripe robust rosy rough round royal rude rusty sad safe
salty sandy scarce secret serene shaky sharp shiny short shy silent silky silly simple sleek
slim slow small smart smoky smooth snowy soft solid sour spare spicy stale stark steady
steep stiff stormy strong sturdy subtle sunny super sweet swift tall tame tender thick thin
tidy tiny tough tribal true twin ugly urban usual vague vain valid vast violet vivid warm
wary weak wealthy weary wet white whole wicked wide wild wise witty wooden woolly young zany
zealous
""".split()
)

NOUNS: tuple[str, ...] = tuple(
    """
acorn actor anchor angle ankle apple apron arch arena arrow atlas attic autumn badge bagel
bakery ballet bamboo banjo barn basket beach beacon beard bell bench berry bicycle biscuit
blanket blossom boat bonnet border bottle boulder bracket branch bread breeze brick bridge
broom bubble bucket bugle butter button cabin cactus camel camera candle canoe canyon carpet
castle cavern cellar chair chalk cherry chimney circus cliff clock cloud clover coast cobweb
comet compass copper coral cottage cradle crater crayon creek cricket crown cup curtain
cushion daisy desert diamond dolphin donkey dragon drum eagle easel elbow engine falcon
feather fence fiddle field finch flag flute forest fossil fountain garden garlic gate
glacier glove goose granite grape guitar hammer harbor harp hatchet helmet hermit hill honey
horizon hornet island ivory jacket jaguar jar jewel kettle kingdom kite ladder lagoon
lantern lemon lily lizard locket magnet mango maple marble meadow melon mirror mitten monkey
moss mountain mushroom needle nest notebook oasis ocean olive orchard otter oven owl paddle
palace panda parrot peach pebble pencil pepper piano pillow pine planet plum pocket pond
potato puzzle quarry quill rabbit radish raft rainbow raven ribbon river robin rocket saddle
sailor salmon satchel scarf scroll shadow shell shovel silver sketch sled sparrow spider
spoon squirrel stable statue stone storm stream sunset swan sword table teapot temple
thimble thunder tiger timber tower tractor trumpet tulip tunnel turtle umbrella valley
velvet village violin volcano wagon walnut walrus whale whistle willow window wizard wolf
yacht zebra
""".split()
)

WORDS: tuple[str, ...] = ADJECTIVES + NOUNS
